"""accelerate.yaml export, checked by accelerate 1.15's own config loader and launch processing (no GPU).

Golden files live in tests/planner/golden/accelerate/; after a reviewed change regenerate them with
``OPTPLAN_UPDATE_GOLDEN=1 python -m pytest tests/planner/test_export_accelerate.py`` and review the diff.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.profile import TransformerShape
from optplan.estimators.strategy import Strategy
from optplan.planner.export.accelerate import MAIN_PROCESS_IP_PLACEHOLDER, render_accelerate_yaml
from optplan.planner.export.accelerate_check import validate_accelerate_yaml
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.validate import ExportValidationError

GOLDEN = Path(__file__).parent / "golden" / "accelerate"
UPDATE = os.environ.get("OPTPLAN_UPDATE_GOLDEN") == "1"

BUCKETS = DeepSpeedBuckets(
    reduce_bucket_size=589_824, allgather_bucket_size=589_824, stage3_prefetch_bucket_size=530_841,
    stage3_param_persistence_threshold=7_680, stage3_max_live_parameters=1_000_000_000,
)
GPT2 = TransformerShape(hidden=768, layers=12, heads=12, vocab=50257, max_seq_len=1024)


def make_plan(*, block_class: str | None = "Block", gpus_per_node: int = 8, transformer: bool = False,
              **strategy: Any) -> ExportPlan:
    return ExportPlan(
        strategy=Strategy(**strategy), model="gpt2", model_path="examples/gpt2.py", block_class=block_class,
        params=124_439_808, transformer=GPT2 if transformer else None, seq_len=1024, buckets=BUCKETS,
        gpu="H100-SXM", gpus_per_node=gpus_per_node,
    )


def load(text: str, tmp_path: Path) -> Any:
    """The file as accelerate's own loader reads it (ClusterConfig)."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config_from_file(str(path))


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# --------------------------------------------------------------------------------------------------
# Golden files
# --------------------------------------------------------------------------------------------------

GOLDEN_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "single_gpu_bf16": ({"engine": "torch", "dp": 1, "mbs": 8, "precision": "amp-bf16"}, {}),
    "ddp_8gpu": ({"engine": "torch", "dp": 8, "mbs": 4, "grad_accum": 4, "precision": "amp-bf16"}, {}),
    "ddp_2x8": ({"engine": "torch", "dp": 16, "mbs": 4, "precision": "amp-bf16"}, {}),
    "fsdp2_full_2x8": ({"engine": "torch", "fsdp": "full", "dp": 16, "mbs": 2, "grad_accum": 4}, {}),
    "fsdp2_grad_op_offload_ckpt": ({"engine": "torch", "fsdp": "grad_op", "dp": 8, "mbs": 4,
                                    "offload_params": "cpu", "checkpointing": "full"}, {}),
    "fsdp2_size_wrap": ({"engine": "torch", "fsdp": "full", "dp": 8, "checkpointing": "selective"},
                        {"block_class": None, "transformer": True}),
    "hsdp2_2x8": ({"engine": "torch", "fsdp": "hybrid", "dp": 16, "mbs": 2}, {}),
    "fsdp1_hybrid_2x8": ({"engine": "torch", "fsdp": "hybrid", "dp": 16, "mbs": 2}, {"fsdp_version": 1}),
    "fsdp1_grad_op": ({"engine": "torch", "fsdp": "grad_op", "dp": 8, "precision": "amp-fp16"},
                      {"fsdp_version": 1}),
    "fsdp2_tp2": ({"engine": "torch", "fsdp": "full", "tp": 2, "dp": 4, "mbs": 2}, {}),
    "deepspeed_zero3_2x8": ({"engine": "deepspeed", "zero": 3, "dp": 16, "mbs": 2, "grad_accum": 2}, {}),
    "megatron_tp4_pp2_2x8": ({"engine": "megatron", "tp": 4, "pp": 2, "dp": 2, "zero": 1, "mbs": 1,
                              "grad_accum": 8, "checkpointing": "full"}, {}),
}
_RENDER_KEYS = ("fsdp_version",)


def _golden_case(name: str) -> tuple[ExportPlan, str]:
    strategy, extra = GOLDEN_CASES[name]
    render_kw = {k: v for k, v in extra.items() if k in _RENDER_KEYS}
    plan_kw = {k: v for k, v in extra.items() if k not in _RENDER_KEYS}
    plan = make_plan(**plan_kw, **strategy)
    return plan, render_accelerate_yaml(plan, **render_kw)


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(name: str) -> None:
    plan, text = _golden_case(name)
    path = GOLDEN / f"{name}.yaml"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden {path}: run with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from {path} (OPTPLAN_UPDATE_GOLDEN=1 updates it)"
    validate_accelerate_yaml(text, plan)


def test_golden_folder_has_no_stale_files() -> None:
    stale = sorted(p.name for p in GOLDEN.glob("*.yaml") if p.stem not in GOLDEN_CASES)
    assert not stale, f"golden files without a case: {stale}"


def test_header_names_optplan_label_and_command() -> None:
    plan, text = _golden_case("fsdp2_full_2x8")
    lines = text.splitlines()
    assert lines[0].startswith("# Generated by optplan")
    assert any(plan.strategy.label() in line for line in lines[:5])
    assert any("accelerate launch --config_file accelerate.yaml --machine_rank $NODE_RANK" in line for line in lines)
    first_key = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    assert all(line.startswith("#") for line in lines[:first_key])
    assert text.endswith("\n")


# --------------------------------------------------------------------------------------------------
# Round trips through accelerate's loaders
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("fsdp", ["full", "grad_op", "hybrid"])
@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_round_trip(version: int, fsdp: str, offload: str, nodes: int, tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp=fsdp, dp=8 * nodes, mbs=2, offload_params=offload,
                     checkpointing="full" if fsdp == "grad_op" else "none")
    text = render_accelerate_yaml(plan, fsdp_version=version)
    validate_accelerate_yaml(text, plan)

    config = load(text, tmp_path)
    assert config.distributed_type.value == "FSDP"
    assert (config.num_processes, config.num_machines) == (8 * nodes, nodes)
    assert config.mixed_precision == "bf16"
    fsdp_config = config.fsdp_config
    assert fsdp_config["fsdp_version"] == version
    assert fsdp_config["fsdp_offload_params"] is (offload == "cpu")
    assert fsdp_config["fsdp_activation_checkpointing"] is (fsdp == "grad_op")
    assert fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Block"
    hsdp = fsdp == "hybrid" and nodes > 1
    if version == 2:
        assert fsdp_config["fsdp_reshard_after_forward"] is (fsdp != "grad_op")
        expected_pc = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 8,
                       "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1} if hsdp else {}
        assert config.parallelism_config == expected_pc
    else:
        want = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD" if hsdp else "FULL_SHARD"}
        assert fsdp_config["fsdp_sharding_strategy"] == want[fsdp]
        assert fsdp_config["fsdp_sync_module_states"] is True
        assert config.parallelism_config == {}
    if nodes > 1:
        assert config.main_process_ip == MAIN_PROCESS_IP_PLACEHOLDER
        assert (config.rdzv_backend, config.same_network, config.main_process_port) == ("c10d", False, 29500)


def _zero_cases() -> list[tuple[int, str, str]]:
    cases = [(0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"), (2, "cpu", "none"),
             (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme"), (3, "none", "cpu")]
    return cases


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize(("zero", "opt", "params"), _zero_cases())
def test_deepspeed_round_trip(zero: int, opt: str, params: str, nodes: int, tmp_path: Path) -> None:
    plan = make_plan(engine="deepspeed", zero=zero, dp=8 * nodes, offload_optimizer=opt, offload_params=params)
    text = render_accelerate_yaml(plan, ds_config_name="ds_config.json")
    validate_accelerate_yaml(text, plan)

    config = load(text, tmp_path)
    assert config.distributed_type.value == "DEEPSPEED"
    assert (config.num_processes, config.num_machines) == (8 * nodes, nodes)
    assert config.mixed_precision is None  # precision lives in ds_config.json
    ds = config.deepspeed_config
    assert ds["deepspeed_config_file"] == "ds_config.json"
    assert ds["zero3_init_flag"] is (zero == 3)
    assert not {"zero_stage", "gradient_accumulation_steps", "offload_optimizer_device"} & set(ds)
    if nodes > 1:  # torchrun on every node, like the other distributed types
        assert ds["deepspeed_multinode_launcher"] == "standard" and "deepspeed_hostfile" not in ds
        assert (config.main_process_ip, config.rdzv_backend, config.same_network) == (
            MAIN_PROCESS_IP_PLACEHOLDER, "c10d", False)


def test_deepspeed_pdsh_launcher_uses_the_hostfile(tmp_path: Path) -> None:
    plan = make_plan(engine="deepspeed", zero=2, dp=16)
    text = render_accelerate_yaml(plan, deepspeed_multinode_launcher="pdsh")
    validate_accelerate_yaml(text, plan)
    config = load(text, tmp_path)
    ds = config.deepspeed_config
    assert (ds["deepspeed_multinode_launcher"], ds["deepspeed_hostfile"]) == ("pdsh", "hostfile")
    assert config.main_process_ip is None  # deepspeed takes the first host of the hostfile
    assert "Launch once, on the first host of hostfile" in text
    assert "deepspeed_hostfile" in _message(edit(text, "  deepspeed_hostfile: hostfile\n", ""), plan)
    with_ip = render_accelerate_yaml(plan, deepspeed_multinode_launcher="pdsh", main_process_ip="10.0.0.1")
    validate_accelerate_yaml(with_ip, plan)
    assert load(with_ip, tmp_path).main_process_ip == "10.0.0.1"


@pytest.mark.parametrize(("dp", "expected"), [(1, "NO"), (8, "MULTI_GPU"), (16, "MULTI_GPU"), (4, "MULTI_GPU")])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16", "bf16-pure", "amp-fp16", "fp16", "fp8"])
def test_ddp_round_trip(dp: int, expected: str, precision: str, tmp_path: Path) -> None:
    plan = make_plan(engine="torch", dp=dp, precision=precision)
    if precision in ("bf16", "fp16"):  # 16-bit weights with fp32 masters: accelerate's switch is autocast
        with pytest.raises(NotExportable, match=f"--precision amp-{precision}"):
            render_accelerate_yaml(plan)
        return
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    config = load(text, tmp_path)
    assert config.distributed_type.value == expected
    assert config.num_processes == dp
    want = {"fp32": "no", "amp-bf16": "bf16", "bf16": "bf16", "bf16-pure": "bf16", "amp-fp16": "fp16",
            "fp16": "fp16", "fp8": "fp8"}[precision]
    assert config.mixed_precision == want
    if precision == "fp8":
        assert config.fp8_config["backend"] == "TE"
    if precision == "bf16-pure":
        assert "model.to(torch.bfloat16)" in text


def test_megatron_round_trip(tmp_path: Path) -> None:
    plan = make_plan(engine="megatron", tp=2, pp=2, cp=2, dp=2, zero=0, grad_accum=4, checkpointing="full",
                     precision="fp16")
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    config = load(text, tmp_path)
    assert config.distributed_type.value == "MEGATRON_LM"
    assert config.mixed_precision == "fp16"
    mlm = config.megatron_lm_config
    assert (mlm["megatron_lm_tp_degree"], mlm["megatron_lm_pp_degree"], mlm["megatron_lm_context_parallel_size"],
            mlm["megatron_lm_num_micro_batches"]) == (2, 2, 2, 4)
    assert mlm["megatron_lm_use_distributed_optimizer"] is False


def test_tensor_parallel_alone_runs_under_multi_gpu(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", tp=8, dp=1, precision="amp-bf16")
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    config = load(text, tmp_path)
    assert config.distributed_type.value == "MULTI_GPU"
    assert config.parallelism_config["parallelism_config_tp_size"] == 8


def test_hsdp_with_tensor_parallel_is_3d(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp="hybrid", tp=2, dp=8)  # 16 GPUs on 2 nodes
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    pc = load(text, tmp_path).parallelism_config
    assert (pc["parallelism_config_dp_replicate_size"], pc["parallelism_config_dp_shard_size"],
            pc["parallelism_config_tp_size"]) == (2, 4, 2)


def test_async_tp_says_how_the_script_turns_it_on(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp="full", tp=2, dp=4, sp=True, compile=True, async_tp=True)
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    assert "_micro_pipeline_tp = True" in text and "enable_symm_mem_for_group" in text
    assert "_micro_pipeline_tp" not in render_accelerate_yaml(make_plan(engine="torch", fsdp="full", tp=2, dp=4))


def test_context_parallel_with_fsdp2(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp="full", cp=2, dp=4)
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)
    pc = load(text, tmp_path).parallelism_config
    assert (pc["parallelism_config_cp_size"], pc["parallelism_config_dp_shard_size"]) == (2, 4)


def test_single_node_hybrid_is_full_shard(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp="hybrid", dp=8)
    for version in (1, 2):
        text = render_accelerate_yaml(plan, fsdp_version=version)
        validate_accelerate_yaml(text, plan)
        assert "single HSDP replica" in text
    assert load(render_accelerate_yaml(plan), tmp_path).parallelism_config == {}


# --------------------------------------------------------------------------------------------------
# Negative tests: the validator
# --------------------------------------------------------------------------------------------------

FSDP_PLAN = make_plan(engine="torch", fsdp="full", dp=16, mbs=2, grad_accum=4)


@pytest.fixture(scope="module")
def fsdp_text() -> str:
    return render_accelerate_yaml(FSDP_PLAN)


def _message(text: str, plan: ExportPlan) -> str:
    with pytest.raises(ExportValidationError) as info:
        validate_accelerate_yaml(text, plan)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_misspelt_nested_fsdp_key(fsdp_text: str) -> None:
    message = _message(edit(fsdp_text, "fsdp_offload_params:", "fsdp_offload_param:"), FSDP_PLAN)
    assert "fsdp_offload_param'" in message and "did you mean 'fsdp_offload_params'" in message


def test_misspelt_nested_deepspeed_key() -> None:
    plan = make_plan(engine="deepspeed", zero=3, dp=8)
    text = edit(render_accelerate_yaml(plan), "zero3_init_flag:", "zero3_init:")
    assert "zero3_init_flag" in _message(text, plan)


def test_unknown_top_level_key(fsdp_text: str) -> None:
    message = _message(fsdp_text + "gradient_accumulation_steps: 4\n", FSDP_PLAN)
    assert "gradient_accumulation_steps" in message and "top-level" in message


def test_misspelt_top_level_key(fsdp_text: str) -> None:
    message = _message(edit(fsdp_text, "num_machines:", "num_machine:"), FSDP_PLAN)
    assert "did you mean 'num_machines'" in message


def test_num_processes_must_match_plan(fsdp_text: str) -> None:
    message = _message(edit(fsdp_text, "num_processes: 16", "num_processes: 8"), FSDP_PLAN)
    assert "num_processes is 8" in message and "num_processes: 16" in message


def test_num_machines_must_match_plan(fsdp_text: str) -> None:
    assert "num_machines: 2" in _message(edit(fsdp_text, "num_machines: 2", "num_machines: 1"), FSDP_PLAN)


def test_mixed_precision_must_match_plan(fsdp_text: str) -> None:
    message = _message(edit(fsdp_text, "mixed_precision: bf16", "mixed_precision: fp16"), FSDP_PLAN)
    assert "mixed_precision" in message and "bf16" in message


def test_mixed_precision_refused_next_to_ds_config() -> None:
    plan = make_plan(engine="deepspeed", zero=2, dp=8)
    text = render_accelerate_yaml(plan) + "mixed_precision: bf16\n"
    assert "remove mixed_precision" in _message(text, plan)


def test_bad_enum_value(fsdp_text: str) -> None:
    text = edit(fsdp_text, "fsdp_state_dict_type: SHARDED_STATE_DICT", "fsdp_state_dict_type: LOCAL_STATE_DICT")
    assert "fsdp_state_dict_type" in _message(text, FSDP_PLAN)


def test_wrong_reshard_for_grad_op() -> None:
    plan = make_plan(engine="torch", fsdp="grad_op", dp=8)
    text = edit(render_accelerate_yaml(plan), "fsdp_reshard_after_forward: false", "fsdp_reshard_after_forward: true")
    assert "fsdp_reshard_after_forward: false" in _message(text, plan)


def test_fsdp1_sharding_from_reshard_alone_is_caught() -> None:
    """`accelerate config` writes FSDP1 sharding under fsdp_reshard_after_forward only; FSDP1 ignores it."""
    plan = make_plan(engine="torch", fsdp="grad_op", dp=8)
    text = edit(render_accelerate_yaml(plan, fsdp_version=1), "  fsdp_sharding_strategy: SHARD_GRAD_OP\n", "")
    message = _message(text, plan)
    assert "FULL_SHARD" in message and "fsdp_sharding_strategy: SHARD_GRAD_OP" in message


def test_wrong_wrap_class(fsdp_text: str) -> None:
    text = edit(fsdp_text, "fsdp_transformer_layer_cls_to_wrap: Block", "fsdp_transformer_layer_cls_to_wrap: Layer")
    assert "fsdp_transformer_layer_cls_to_wrap: Block" in _message(text, FSDP_PLAN)


def test_no_wrap_is_refused(fsdp_text: str) -> None:
    text = edit(fsdp_text, "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_auto_wrap_policy: NO_WRAP")
    assert "one FSDP unit" in _message(text, FSDP_PLAN)


def test_cpu_ram_efficient_loading_needs_sync_under_fsdp1() -> None:
    plan = make_plan(engine="torch", fsdp="full", dp=8)
    text = edit(render_accelerate_yaml(plan, fsdp_version=1), "fsdp_sync_module_states: true",
                "fsdp_sync_module_states: false")
    assert "sync_module_states" in _message(text, plan)


def test_c10d_on_same_network_has_no_endpoint(fsdp_text: str) -> None:
    assert "same_network: false" in _message(edit(fsdp_text, "same_network: false", "same_network: true"), FSDP_PLAN)


def test_hsdp_sizes_checked() -> None:
    plan = make_plan(engine="torch", fsdp="hybrid", dp=16)
    text = render_accelerate_yaml(plan)
    bad = edit(text, "parallelism_config_dp_shard_size: 8", "parallelism_config_dp_shard_size: 4")
    assert "multiply to 8" in _message(bad, plan)
    assert "parallelism_config" in _message(edit(text, "parallelism_config:\n", "parallelism_confg:\n"), plan)


def test_megatron_context_parallel_default_is_caught() -> None:
    plan = make_plan(engine="megatron", tp=2, pp=2, dp=2, checkpointing="full")
    text = edit(render_accelerate_yaml(plan), "  megatron_lm_context_parallel_size: 1\n", "")
    assert "context_parallel_size=2" in _message(text, plan)


def test_zero3_init_flag_checked() -> None:
    plan = make_plan(engine="deepspeed", zero=2, dp=8)
    text = edit(render_accelerate_yaml(plan), "zero3_init_flag: false", "zero3_init_flag: true")
    assert "zero3_init_flag: false" in _message(text, plan)


def test_distributed_type_must_match_engine(fsdp_text: str) -> None:
    message = _message(edit(fsdp_text, "distributed_type: FSDP", "distributed_type: MULTI_GPU"), FSDP_PLAN)
    assert "set distributed_type: FSDP" in message


def test_file_for_an_unexportable_plan_is_refused() -> None:
    text = render_accelerate_yaml(make_plan(engine="torch", dp=8, precision="amp-bf16"))
    message = _message(text, make_plan(engine="torch", pp=2, dp=4))
    assert "cannot run under accelerate" in message and "--pp 1" in message


def test_not_a_mapping() -> None:
    assert "mapping" in _message("- a\n- b\n", FSDP_PLAN)
    assert "YAML" in _message("key: [unclosed\n", FSDP_PLAN)


def test_validation_is_hermetic(fsdp_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate variables of the caller's shell neither leak in nor get lost; loggers are left as found."""
    monkeypatch.setenv("FSDP_VERSION", "1")
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    before = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    validate_accelerate_yaml(fsdp_text, FSDP_PLAN)
    assert dict(os.environ) == before
    assert (list(root.handlers), root.level) == (handlers, level)
    assert not logging.getLogger("accelerate.utils.dataclasses").filters


# --------------------------------------------------------------------------------------------------
# Plans accelerate cannot run: NotExportable
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "extra", "fragment"), [
    ({"engine": "torch", "pp": 2, "dp": 4}, {}, "launch.sh"),
    ({"engine": "deepspeed", "tp": 2, "dp": 4, "zero": 1}, {}, "Megatron-DeepSpeed"),
    ({"engine": "deepspeed", "zero": 0, "dp": 8, "precision": "bf16-pure"}, {}, "ds_config.json"),
    ({"engine": "deepspeed", "zero": 2, "dp": 8, "precision": "fp8"}, {}, "fp8"),
    ({"engine": "megatron", "tp": 2, "pp": 2, "vpp": 2, "dp": 2, "grad_accum": 4, "checkpointing": "full"}, {}, "--vpp 1"),
    ({"engine": "megatron", "tp": 2, "dp": 4}, {}, "--checkpointing full"),
    ({"engine": "megatron", "tp": 2, "dp": 4, "checkpointing": "selective"}, {}, "--checkpointing full"),
    ({"engine": "megatron", "tp": 2, "dp": 4, "checkpointing": "full", "precision": "amp-bf16"}, {}, "--precision bf16"),
    ({"engine": "torch", "tp": 2, "dp": 4, "precision": "amp-bf16"}, {}, "--fsdp full"),
    ({"engine": "torch", "cp": 2, "dp": 4, "precision": "amp-bf16"}, {}, "FSDP2"),
    ({"engine": "torch", "dp": 8, "precision": "bf16"}, {}, "--precision amp-bf16"),
    ({"engine": "torch", "dp": 1, "precision": "fp16"}, {}, "--precision amp-fp16"),
    ({"engine": "torch", "fsdp": "full", "tp": 2, "dp": 4}, {"fsdp_version": 1}, "fsdp_version=2"),
    ({"engine": "torch", "fsdp": "full", "tp": 8, "dp": 1}, {}, "--fsdp none"),
    ({"engine": "torch", "dp": 12}, {}, "whole number"),
    ({"engine": "torch", "fsdp": "full", "dp": 8}, {"fsdp_version": 3}, "fsdp_version must be 1 or 2"),
    ({"engine": "torch", "fsdp": "full", "dp": 8}, {"block_class": "my block"}, "class name"),
])
def test_not_exportable(strategy: dict[str, Any], extra: dict[str, Any], fragment: str) -> None:
    render_kw = {k: v for k, v in extra.items() if k in _RENDER_KEYS}
    plan = make_plan(**{k: v for k, v in extra.items() if k not in _RENDER_KEYS}, **strategy)
    with pytest.raises(NotExportable) as info:
        render_accelerate_yaml(plan, **render_kw)
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_rendered_yaml_is_plain_yaml() -> None:
    """Every golden parses as YAML with 'NO'/'no' kept as strings (a bare NO is a YAML 1.1 boolean)."""
    _plan, text = _golden_case("single_gpu_bf16")
    data = yaml.safe_load(text)
    assert data["distributed_type"] == "NO" and data["downcast_bf16"] == "no"


def test_compile_plans_carry_accelerates_regional_compilation(tmp_path: Path) -> None:
    plan = make_plan(engine="torch", fsdp="full", dp=8, mbs=2, compile=True)
    text = render_accelerate_yaml(plan)
    validate_accelerate_yaml(text, plan)  # accelerate's loader and its launch parser take the keys
    assert load(text, tmp_path).dynamo_config == {"dynamo_backend": "INDUCTOR",
                                                  "dynamo_use_regional_compilation": True}
    eager = render_accelerate_yaml(make_plan(engine="torch", fsdp="full", dp=8, mbs=2))
    assert "dynamo_config" not in eager


@pytest.mark.parametrize("version", [1, 2])
def test_fp32_reduction_names_the_policy_accelerate_needs(version: int) -> None:
    """accelerate's FSDP plugin reduces in the mixed-precision dtype unless given a policy (set_mixed_precision):
    an fp32-reducing plan's header names one, and accelerate's own plugin takes it as written."""
    import re

    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    text = render_accelerate_yaml(make_plan(engine="torch", fsdp="full", dp=8, mbs=2), fsdp_version=version)
    header = " ".join(line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#"))
    found = re.search(r"mixed_precision_policy=(\{[^}]*\})", header)
    assert found and "FSDP gradient reduction in fp32" in header
    dtypes = {k: getattr(torch, v) for k, v in re.findall(r"'(\w+)': torch\.(\w+)", found.group(1))}
    assert set(dtypes) == ({"param_dtype", "reduce_dtype", "buffer_dtype"} if version == 1
                           else {"param_dtype", "reduce_dtype"})
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, mixed_precision_policy=dtypes)
    assert plugin.mixed_precision_policy.reduce_dtype == torch.float32
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16
    # a plan that reduces in bf16 runs as accelerate does by default: no such line
    low = render_accelerate_yaml(make_plan(engine="torch", fsdp="full", dp=8, mbs=2, fsdp_reduce_dtype="bf16"),
                                 fsdp_version=version)
    assert "mixed_precision_policy" not in low
