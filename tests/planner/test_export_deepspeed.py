"""ds_config.json export, round-tripped through DeepSpeed's own config parser (no GPU needed)."""

from __future__ import annotations

import copy
import json
import logging
import subprocess
import sys

import pytest

from optplan.estimators.buckets import deepspeed_buckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import ActivationFit, ModelProfile, RepeatedBlock, TransformerShape
from optplan.estimators.strategy import Strategy
from optplan.planner.export.deepspeed import (
    ADAFACTOR_NOTE,
    CLIENT_OPTIMIZER_NOTE,
    DEFAULT_NVME_PATH,
    SELECTIVE_CHECKPOINTING_NOTE,
    deepspeed_notes,
    ds_config_text,
    render_ds_config,
)
from optplan.planner.validate import ExportValidationError, load_ds_config, validate_ds_config

# A 1.3B GPT-like model: 12·L·h² + V·h parameters, 24 layers, hidden 2048, vocab 50304.
HIDDEN, LAYERS, VOCAB, SEQ = 2048, 24, 50304, 2048
PARAMS = 12 * LAYERS * HIDDEN**2 + VOCAB * HIDDEN  # 1,310,982,144


def make_profile(*, transformer: bool = True) -> ModelProfile:
    per_token_layer = 34 * HIDDEN  # bf16 activation bytes per token per layer (Korthikanti et al.)
    fits = (
        ActivationFit(precision="bf16", checkpointing="none", fixed_bytes=0,
                      per_sample_bytes=per_token_layer * SEQ * LAYERS),
        ActivationFit(precision="fp32", checkpointing="none", fixed_bytes=0,
                      per_sample_bytes=2 * per_token_layer * SEQ * LAYERS),
        ActivationFit(precision="bf16", checkpointing="full", fixed_bytes=0,
                      per_sample_bytes=2 * HIDDEN * SEQ * LAYERS + per_token_layer * SEQ),
        ActivationFit(precision="fp32", checkpointing="full", fixed_bytes=0,
                      per_sample_bytes=2 * (2 * HIDDEN * SEQ * LAYERS + per_token_layer * SEQ)),
    )
    return ModelProfile(
        name="gpt-1.3b", path="gpt.py", model_class="GPT", params=PARAMS, trainable_params=PARAMS,
        params_by_module={"wte": VOCAB * HIDDEN, "h": 12 * LAYERS * HIDDEN**2},
        repeated_block=RepeatedBlock(class_name="Block", count=LAYERS, params_per_block=12 * HIDDEN**2, path="h"),
        input_kind="tokens", seq_len=SEQ, tokens_per_sample=SEQ,
        fwd_flops_per_sample=2.0 * PARAMS * SEQ, bwd_flops_per_sample=4.0 * PARAMS * SEQ, activations=fits,
        transformer=TransformerShape(hidden=HIDDEN, layers=LAYERS, heads=16, vocab=VOCAB, max_seq_len=SEQ)
        if transformer else None,
    )


PROFILE = make_profile()


@pytest.fixture(scope="module")
def ds_config_module():
    """deepspeed.runtime.config, imported once for the module (about 1.6 s)."""
    from optplan.planner.validate import _import_deepspeed

    return _import_deepspeed()


def strategy(**kw) -> Strategy:
    base = dict(precision="bf16", zero=0, mbs=2, grad_accum=4, dp=8)
    base.update(kw)
    return Strategy(**base)


# --- round trip: render, then DeepSpeed parses it for the same world size --------------------------


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "amp-bf16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_round_trip_validates(ds_config_module, zero, precision, checkpointing, world):
    s = strategy(precision=precision, zero=zero, checkpointing=checkpointing, dp=world)
    config = render_ds_config(s, PROFILE)
    validate_ds_config(config, world_size=world)
    parsed = json.loads(ds_config_text(s, PROFILE))
    assert parsed == config
    validate_ds_config(parsed, world_size=world)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("precision", ["amp-fp16", "bf16-pure"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adamw-8bit"])
def test_other_recipes_and_optimizers_validate(ds_config_module, zero, precision, optimizer):
    validate_ds_config(render_ds_config(strategy(precision=precision, zero=zero, optimizer=optimizer), PROFILE),
                       world_size=8)


@pytest.mark.parametrize("opt, params, zero", [
    ("cpu", "none", 1), ("cpu", "none", 2), ("cpu", "none", 3), ("cpu", "cpu", 3), ("nvme", "none", 3),
    ("none", "nvme", 3), ("nvme", "nvme", 3), ("cpu", "nvme", 3),
])
def test_offload_configs_validate(ds_config_module, opt, params, zero):
    s = strategy(zero=zero, offload_optimizer=opt, offload_params=params)
    config = render_ds_config(s, PROFILE, nvme_path="/mnt/nvme0")
    validate_ds_config(config, world_size=8)
    zero_section = config["zero_optimization"]
    for key, device in (("offload_optimizer", opt), ("offload_param", params)):
        if device == "none":
            assert key not in zero_section
        else:
            expected = {"device": device, "pin_memory": True}
            if device == "nvme":
                expected["nvme_path"] = "/mnt/nvme0"
            assert zero_section[key] == expected
    parsed = load_ds_config(config, world_size=8).zero_config
    for section, device in ((parsed.offload_optimizer, opt), (parsed.offload_param, params)):
        if device != "none":
            assert getattr(section.device, "value", section.device) == device  # an enum value (str)


def test_nvme_offload_gets_default_path():
    config = render_ds_config(strategy(zero=3, offload_params="nvme"), PROFILE)
    assert config["zero_optimization"]["offload_param"]["nvme_path"] == DEFAULT_NVME_PATH == "/local_nvme"
    with pytest.raises(OptplanError, match="--nvme-path"):
        render_ds_config(strategy(zero=3, offload_params="nvme"), PROFILE, nvme_path=" ")


# --- contents ----------------------------------------------------------------------------------------


def test_batch_triple_and_fixed_keys():
    s = strategy(mbs=3, grad_accum=5, dp=16)
    config = render_ds_config(s, PROFILE, gradient_clipping=0.5)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (240, 3, 5)
    assert config["gradient_clipping"] == 0.5
    assert config["steps_per_print"] == 100
    assert config["wall_clock_breakdown"] is False
    assert "activation_checkpointing" not in config


def test_text_is_indented_json_with_trailing_newline():
    text = ds_config_text(strategy(), PROFILE)
    assert text.endswith("}\n") and text.startswith("{\n  \"")
    assert json.loads(text) == render_ds_config(strategy(), PROFILE)


@pytest.mark.parametrize("precision, expected", [
    ("fp32", {"bf16": {"enabled": False}, "fp16": {"enabled": False}}),
    ("bf16", {"bf16": {"enabled": True}}),
    ("fp16", {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}}),
    ("amp-bf16", {"bf16": {"enabled": False}, "fp16": {"enabled": False},
                  "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    ("amp-fp16", {"bf16": {"enabled": False}, "fp16": {"enabled": False},
                  "torch_autocast": {"enabled": True, "dtype": "float16"}}),
    ("bf16-pure", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                            "bf16_optimizer_states": True}}),
])
def test_precision_sections(ds_config_module, precision, expected):
    config = render_ds_config(strategy(precision=precision, zero=1), PROFILE)
    got = {k: config[k] for k in ("bf16", "fp16", "torch_autocast") if k in config}
    assert got == expected
    parsed = load_ds_config(config, world_size=8)
    assert parsed.bfloat16_config.enabled == (precision in ("bf16", "bf16-pure"))
    assert parsed.float16_config.enabled == (precision == "fp16")
    assert parsed.torch_autocast_enabled == precision.startswith("amp-")
    if precision.startswith("amp-"):
        import torch

        assert parsed.torch_autocast_dtype == {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}[precision]
    assert parsed.bfloat16_config.bf16_master_weights_and_grads == (precision == "bf16-pure")
    assert parsed.bfloat16_config.bf16_optimizer_states == (precision == "bf16-pure")


def test_optimizer_sections():
    adamw = render_ds_config(strategy(optimizer="adamw", zero=2), PROFILE)
    assert adamw["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                              "weight_decay": 0.1}}
    assert "zero_allow_untested_optimizer" not in adamw
    sgd = render_ds_config(strategy(optimizer="sgd", zero=2), PROFILE)
    assert sgd["optimizer"]["type"] == "SGD" and sgd["optimizer"]["params"]["momentum"] == 0.9
    assert sgd["zero_allow_untested_optimizer"] is True  # torch.optim.SGD is not in ZeRO's tested list
    assert "zero_allow_untested_optimizer" not in render_ds_config(strategy(optimizer="sgd", zero=0), PROFILE)


def test_adamw_8bit_is_client_side():
    s = strategy(optimizer="adamw-8bit", zero=2)
    config = render_ds_config(s, PROFILE)
    assert "optimizer" not in config
    assert config["zero_allow_untested_optimizer"] is True
    assert CLIENT_OPTIMIZER_NOTE in deepspeed_notes(s)
    assert "deepspeed.initialize(optimizer=" in CLIENT_OPTIMIZER_NOTE
    assert "zero_allow_untested_optimizer" not in render_ds_config(strategy(optimizer="adamw-8bit"), PROFILE)


def test_zero_section_stages():
    buckets = deepspeed_buckets(PROFILE)
    for zero in (0, 1, 2):
        section = render_ds_config(strategy(zero=zero), PROFILE)["zero_optimization"]
        assert section == {"stage": zero, "overlap_comm": True, "contiguous_gradients": True, "reduce_scatter": True,
                           "reduce_bucket_size": buckets.reduce_bucket_size,
                           "allgather_bucket_size": buckets.allgather_bucket_size}
    section = render_ds_config(strategy(zero=3), PROFILE)["zero_optimization"]
    assert section["stage3_gather_16bit_weights_on_model_save"] is True
    assert section["stage3_max_live_parameters"] == buckets.stage3_max_live_parameters


@pytest.mark.parametrize("transformer", [True, False])
def test_stage3_buckets_match_estimator_through_deepspeed(ds_config_module, transformer):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    profile = make_profile(transformer=transformer)
    buckets = deepspeed_buckets(profile)
    config = render_ds_config(strategy(zero=3), profile)
    for zc in (DeepSpeedZeroConfig(**config["zero_optimization"]),
               load_ds_config(config, world_size=8).zero_config):
        assert int(zc.stage) == 3
        assert zc.reduce_bucket_size == buckets.reduce_bucket_size
        assert zc.allgather_bucket_size == buckets.allgather_bucket_size
        assert zc.prefetch_bucket_size == buckets.stage3_prefetch_bucket_size
        assert zc.param_persistence_threshold == buckets.stage3_param_persistence_threshold
        assert zc.max_live_parameters == buckets.stage3_max_live_parameters
        assert zc.gather_16bit_weights_on_model_save is True
        assert zc.overlap_comm is True and zc.contiguous_gradients is True and zc.reduce_scatter is True
    if transformer:
        assert buckets.reduce_bucket_size == HIDDEN * HIDDEN


def test_activation_checkpointing_section(ds_config_module):
    config = render_ds_config(strategy(checkpointing="full"), PROFILE)
    assert config["activation_checkpointing"] == {"partition_activations": False,
                                                  "contiguous_memory_optimization": False, "cpu_checkpointing": False}
    parsed = load_ds_config(config, world_size=8).activation_checkpointing_config
    assert parsed.partition_activations is False and parsed.cpu_checkpointing is False


# --- strategies DeepSpeed cannot run as planned --------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(precision="bf16-pure", zero=0), "bf16-pure needs ZeRO stage 1-3.*--zero 1"),
    (dict(optimizer="adamw-8bit", zero=2, offload_optimizer="cpu"), "adamw-8bit.*--optimizer adamw"),
    (dict(precision="bf16-pure", optimizer="sgd", zero=2, offload_optimizer="cpu"), "CPU Adam"),
    # NVMe optimizer offload below ZeRO-3 is refused by Strategy itself (tests/estimators/test_memory.py)
])
def test_unexportable_strategies_raise(kw, match):
    with pytest.raises(OptplanError, match=match):
        render_ds_config(strategy(**kw), PROFILE)


def test_negative_gradient_clipping_rejected():
    with pytest.raises(OptplanError, match="gradient clipping"):
        render_ds_config(strategy(), PROFILE, gradient_clipping=-1.0)


# --- the validator catches what it must --------------------------------------------------------------


@pytest.fixture
def good_config() -> dict:
    return render_ds_config(strategy(zero=3, mbs=2, grad_accum=4, dp=8), PROFILE)


def test_validation_catches_world_size_mismatch(ds_config_module, good_config):
    with pytest.raises(ExportValidationError, match=r"world size 4.*64 != 2 \* 4 \* 4"):
        validate_ds_config(good_config, world_size=4)


def test_validation_catches_batch_triple_mismatch(ds_config_module, good_config):
    good_config["train_batch_size"] = 63
    with pytest.raises(ExportValidationError, match="batch"):
        validate_ds_config(good_config, world_size=8)


def test_validation_requires_whole_batch_triple(ds_config_module, good_config):
    del good_config["gradient_accumulation_steps"]
    with pytest.raises(ExportValidationError, match="lacks gradient_accumulation_steps"):
        validate_ds_config(good_config, world_size=8)


def test_validation_catches_fp16_and_bf16(ds_config_module, good_config):
    good_config["fp16"] = {"enabled": True}
    with pytest.raises(ExportValidationError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        validate_ds_config(good_config, world_size=8)


def test_validation_catches_unknown_zero_key(ds_config_module, good_config):
    good_config["zero_optimization"]["stage3_prefetch_bucket"] = 10
    with pytest.raises(ExportValidationError, match="DeepSpeedZeroConfig: stage3_prefetch_bucket: Extra inputs"):
        validate_ds_config(good_config, world_size=8)


def test_validation_catches_unknown_top_level_key(ds_config_module, good_config):
    good_config["gradient_clip"] = 1.0
    with pytest.raises(ExportValidationError, match="'gradient_clip' \\(did you mean 'gradient_clipping'\\?\\)"):
        validate_ds_config(good_config, world_size=8)


@pytest.mark.parametrize("key", ["zero_optimization", "bf16", "torch_autocast", "optimizer", "scheduler",
                                 "activation_checkpointing", "flops_profiler", "tensorboard", "aio",
                                 "zero_allow_untested_optimizer", "communication_data_type"])
def test_known_top_level_keys_are_accepted(ds_config_module, good_config, key):
    extra = {"zero_optimization": good_config["zero_optimization"], "bf16": {"enabled": True},
             "torch_autocast": {"enabled": False}, "optimizer": good_config["optimizer"],
             "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
             "activation_checkpointing": {}, "flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False},
             "aio": {}, "zero_allow_untested_optimizer": True, "communication_data_type": "fp32"}
    good_config[key] = extra[key]
    validate_ds_config(good_config, world_size=8)


def test_validation_catches_nvme_without_path(ds_config_module):
    config = render_ds_config(strategy(zero=3, dp=1, offload_optimizer="nvme", offload_params="nvme"), PROFILE)
    for key in ("offload_optimizer", "offload_param"):
        broken = copy.deepcopy(config)
        del broken["zero_optimization"][key]["nvme_path"]
        ds_config_module.DeepSpeedConfig(copy.deepcopy(broken))  # DeepSpeed itself accepts it (world size 1) ...
        with pytest.raises(ExportValidationError, match=f"{key} offloads to nvme without nvme_path"):
            validate_ds_config(broken, world_size=1)  # ... the validator does not


def test_validation_catches_nvme_optimizer_offload_below_stage3(ds_config_module):
    config = render_ds_config(strategy(zero=3, offload_optimizer="nvme"), PROFILE)
    config["zero_optimization"]["stage"] = 2
    with pytest.raises(ExportValidationError, match="ZeRO-2"):
        validate_ds_config(config, world_size=8)


def test_validation_catches_bf16_pure_at_zero0(ds_config_module):
    config = render_ds_config(strategy(precision="bf16-pure", zero=1), PROFILE)
    config["zero_optimization"]["stage"] = 0
    with pytest.raises(ExportValidationError, match="only supported with ZeRO Stage 1, 2, or 3"):
        validate_ds_config(config, world_size=8)


def test_validation_rejects_auto_and_bad_input(ds_config_module, good_config):
    good_config["zero_optimization"]["reduce_bucket_size"] = "auto"
    with pytest.raises(ExportValidationError, match="zero_optimization.reduce_bucket_size"):
        validate_ds_config(good_config, world_size=8)
    with pytest.raises(ExportValidationError, match="JSON object"):
        validate_ds_config([], world_size=8)  # type: ignore[arg-type]
    with pytest.raises(ExportValidationError, match="world size"):
        validate_ds_config({}, world_size=0)


def test_validation_errors_are_one_line_optplan_errors(ds_config_module, good_config):
    good_config["zero_optimization"]["bogus"] = 1
    good_config["zero_optimization"]["stage"] = 7
    with pytest.raises(OptplanError) as info:
        validate_ds_config(good_config, world_size=8)
    assert "\n" not in str(info.value)


def test_validation_leaves_no_global_state(ds_config_module, good_config):
    dist = ds_config_module.dist
    before = (dist.get_rank, dist.get_world_size)
    filters_before = list(logging.getLogger("DeepSpeed").filters)
    snapshot = copy.deepcopy(good_config)
    validate_ds_config(good_config, world_size=8)
    with pytest.raises(ExportValidationError):
        validate_ds_config(good_config, world_size=3)
    assert (dist.get_rank, dist.get_world_size) == before
    assert logging.getLogger("DeepSpeed").filters == filters_before
    assert good_config == snapshot  # the caller's dict is untouched


def test_exporters_do_not_import_deepspeed():
    code = ("import sys; import optplan.planner.export, optplan.planner.export.deepspeed, "
            "optplan.planner.export.launch, optplan.planner.export.launch_check, optplan.planner.export.files, optplan.planner.validate; "
            "sys.exit(1 if 'deepspeed' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- plans a ds_config.json cannot express (issue 3) ---------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(engine="torch"), r"^this plan runs on the torch engine \(DDP/FSDP\), which ds_config.json cannot "
                           r"configure: export it for torch FSDP/accelerate instead, or plan with --engine deepspeed$"),
    (dict(engine="torch", fsdp="full"), "torch engine.*FSDP/accelerate"),
    (dict(engine="megatron", zero=1), r"^this plan runs on the megatron engine.*Megatron-LM's own arguments.*"
                                      r"--engine deepspeed$"),
    (dict(tp=2, dp=4), r"^DeepSpeed's ds_config.json covers ZeRO data parallelism, and this plan uses tp=2: "
                       r"tensor/pipeline/context-parallel plans need Megatron-DeepSpeed arguments; plan with "
                       r"--tp 1 --pp 1 --cp 1 for a ds_config.json$"),
    (dict(pp=2, dp=4, zero=1), "uses pp=2: .*Megatron-DeepSpeed arguments"),
    (dict(cp=2, dp=4), "uses cp=2: .*Megatron-DeepSpeed arguments"),
    (dict(tp=2, pp=2, dp=2), "uses tp=2, pp=2: "),
    (dict(precision="fp8"), r"^DeepSpeed's config has no fp8 recipe: use Transformer Engine \(te.fp8_autocast "
                            r"around TE layers\) in the training script, or plan with --precision bf16$"),
    (dict(precision="fp8", zero=3), "no fp8 recipe"),
    (dict(optimizer="adafactor", zero=2, offload_optimizer="cpu"), "adafactor.*CPU Adam.*--optimizer adamw"),
])
def test_inexpressible_plans_are_refused(kw, match):
    s = strategy(**kw)
    with pytest.raises(OptplanError, match=match) as info:
        render_ds_config(s, PROFILE)
    assert "\n" not in str(info.value)
    with pytest.raises(OptplanError):
        ds_config_text(s, PROFILE)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16", "bf16", "fp16"])
def test_adafactor_is_client_side_and_validates(ds_config_module, zero, precision):
    s = strategy(optimizer="adafactor", zero=zero, precision=precision)
    config = render_ds_config(s, PROFILE)
    assert "optimizer" not in config
    assert config.get("zero_allow_untested_optimizer") is (True if zero > 0 else None)
    validate_ds_config(config, world_size=8)
    assert load_ds_config(config, world_size=8).zero_allow_untested_optimizer == (zero > 0)
    notes = deepspeed_notes(s)
    assert ADAFACTOR_NOTE in notes and CLIENT_OPTIMIZER_NOTE not in notes
    assert "torch.optim.Adafactor(model.parameters()" in ADAFACTOR_NOTE
    assert "deepspeed.initialize(optimizer=...)" in ADAFACTOR_NOTE


def test_adafactor_with_bf16_pure_validates(ds_config_module):
    validate_ds_config(render_ds_config(strategy(optimizer="adafactor", precision="bf16-pure", zero=2), PROFILE),
                       world_size=8)


def test_client_notes_name_the_registry_key():
    assert CLIENT_OPTIMIZER_NOTE in deepspeed_notes(strategy(optimizer="adamw8bit", zero=1))
    assert "adamw8bit" in CLIENT_OPTIMIZER_NOTE
    assert not any("Adafactor" in n for n in deepspeed_notes(strategy(optimizer="adamw", zero=1)))


@pytest.mark.parametrize("zero", [0, 3])
def test_selective_checkpointing_gets_a_note_not_a_section(ds_config_module, zero):
    s = strategy(checkpointing="selective", zero=zero)
    config = render_ds_config(s, PROFILE)
    assert "activation_checkpointing" not in config
    validate_ds_config(config, world_size=8)
    notes = deepspeed_notes(s)
    assert SELECTIVE_CHECKPOINTING_NOTE in notes
    assert "every other matmul" in SELECTIVE_CHECKPOINTING_NOTE and "torch.utils.checkpoint" in SELECTIVE_CHECKPOINTING_NOTE
    assert not any("deepspeed.checkpointing" in n for n in notes)  # that note is for full checkpointing
    assert SELECTIVE_CHECKPOINTING_NOTE not in deepspeed_notes(strategy(checkpointing="full"))
