"""launch.sh and hostfile: golden files, valid bash, and launcher lines that torch's and DeepSpeed's own
parsers accept, read back statically and from a real bash run with a fake launcher on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import TransformerShape
from optplan.estimators.strategy import Strategy
from optplan.planner.export import launch_check
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.launch import (
    RUNTIME_PLACEHOLDERS,
    launched_command,
    render_hostfile,
    render_launch_sh,
)
from optplan.planner.export.launch_check import launch_argv, validate_launch_sh
from optplan.planner.validate import ExportValidationError

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")
GOLDEN = Path(__file__).parent / "golden" / "launch"

NASTY = "my train's $HOME `id` \"x\".py"
NASTY_CONFIG = "ds config $(id) 'q'.json"

BUCKETS = DeepSpeedBuckets(reduce_bucket_size=16_777_216, allgather_bucket_size=16_777_216,
                           stage3_prefetch_bucket_size=15_099_494, stage3_param_persistence_threshold=40_960,
                           stage3_max_live_parameters=1_000_000_000)
LLAMA_70B = TransformerShape(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=128256, ffn=28672, gated=True)
LLAMA_8B = TransformerShape(hidden=4096, layers=32, heads=32, kv_heads=8, vocab=128256, ffn=14336, gated=True,
                            max_seq_len=8192)


def make_plan(strategy: Strategy, *, shape: TransformerShape | None = LLAMA_8B, model: str = "llama-8b",
              gpus_per_node: int = 8, **kw) -> ExportPlan:
    fields = dict(strategy=strategy, model=model, model_path="model.py", block_class="LlamaDecoderLayer",
                  params=8_030_261_248, transformer=shape, seq_len=4096, buckets=BUCKETS, gpu="H100-SXM",
                  gpus_per_node=gpus_per_node)
    fields.update(kw)
    return ExportPlan(**fields)


def ds_zero2_1node() -> ExportPlan:
    return make_plan(Strategy(precision="bf16", zero=2, mbs=4, grad_accum=2, dp=8))


def ds_zero3_offload_4x8() -> ExportPlan:
    return make_plan(Strategy(precision="bf16", zero=3, mbs=1, grad_accum=4, dp=32, checkpointing="full",
                              offload_optimizer="cpu", offload_params="cpu"),
                     shape=LLAMA_70B, model="llama-70b", params=70_553_706_496)


def fsdp_2nodes() -> ExportPlan:
    return make_plan(Strategy(engine="torch", fsdp="full", precision="bf16", mbs=2, grad_accum=4, dp=16,
                              checkpointing="full"))


def megatron_16nodes() -> ExportPlan:
    return make_plan(Strategy(engine="megatron", tp=8, pp=4, vpp=2, dp=4, mbs=1, grad_accum=16),
                     shape=LLAMA_70B, model="llama-70b", params=70_553_706_496)


def ds_zero2_2nodes() -> ExportPlan:
    return make_plan(Strategy(precision="bf16", zero=2, mbs=4, grad_accum=2, dp=16))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("OPTPLAN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"missing golden file {path}: run the tests with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file (OPTPLAN_UPDATE_GOLDEN=1)"


GOLDEN_CASES = {
    "deepspeed_zero2_1node.sh": (ds_zero2_1node, "torchrun"),
    "deepspeed_zero3_offload_4x8.sh": (ds_zero3_offload_4x8, "torchrun"),
    "fsdp_2nodes.sh": (fsdp_2nodes, "torchrun"),
    "megatron_tp8_pp4_vpp2_16nodes.sh": (megatron_16nodes, "torchrun"),
    "deepspeed_launcher_2nodes.sh": (ds_zero2_2nodes, "deepspeed"),
    "deepspeed_launcher_1node.sh": (ds_zero2_1node, "deepspeed"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_and_valid(name):
    make, launcher = GOLDEN_CASES[name]
    plan = make()
    text = render_launch_sh(plan, launcher=launcher)
    check_golden(name, text)
    validate_launch_sh(text, plan)


def test_golden_hostfile():
    plan = ds_zero2_2nodes()
    text = render_hostfile(plan)
    check_golden("hostfile_2nodes", text)
    assert text.splitlines()[-2:] == ["node0 slots=8", "node1 slots=8"]


# --------------------------------------------------------------------------------------------------
# Running the script with a fake launcher, and reading the launcher line back without running it
# --------------------------------------------------------------------------------------------------

FAKE_LAUNCHER = """#!/usr/bin/env bash
: > "$ARGS_OUT"
for a in "$@"; do printf '%s\\0' "$a" >> "$ARGS_OUT"; done
printf '%s\\0' "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-}" > "$ARGS_OUT.env"
printf '%s\\0' "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST-unset}" >> "$ARGS_OUT.env"
"""
CLEAN_ENV = ("TRAIN_SCRIPT", "DS_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RDZV_ID", "HOSTFILE", "MEGATRON_LM",
             "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_CUDA_ARCH_LIST")


def run_script(text: str, tmp_path: Path, *args: str, program: str = "torchrun", env: dict[str, str] | None = None,
               files: dict[str, str] | None = None):
    """Run launch.sh from tmp_path/export with a fake ``program`` first on PATH.

    Returns (result, the argv the fake launcher got (program name first) or None, its environment line).
    """
    folder = tmp_path / "export"
    folder.mkdir(exist_ok=True)
    script = folder / "launch.sh"
    script.write_text(text)
    for name, content in (files or {}).items():
        (folder / name).write_text(content)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / program
    fake.write_text(FAKE_LAUNCHER)
    fake.chmod(0o755)
    args_out = tmp_path / "argv"
    full_env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", ARGS_OUT=str(args_out))
    full_env.update(env or {})
    result = subprocess.run([BASH, str(script), *args], capture_output=True, text=True, env=full_env, cwd=tmp_path,
                            timeout=30)
    if not args_out.exists():
        return result, None, None
    argv = [program] + [a.decode() for a in args_out.read_bytes().split(b"\0")[:-1]]
    env_line = Path(f"{args_out}.env").read_bytes().split(b"\0")[0].decode()
    return result, argv, env_line


def static_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return dict(RUNTIME_PLACEHOLDERS, SCRIPT_DIR=str(tmp_path / "export"), **extra)


@needs_bash
@pytest.mark.parametrize("make, launcher", [
    (ds_zero2_1node, "torchrun"), (ds_zero3_offload_4x8, "torchrun"), (fsdp_2nodes, "torchrun"),
    (megatron_16nodes, "torchrun"), (ds_zero2_1node, "deepspeed"), (ds_zero3_offload_4x8, "deepspeed"),
])
def test_bash_syntax_with_nasty_names(make, launcher):
    plan = make()
    text = render_launch_sh(plan, launcher=launcher, train_script=NASTY, ds_config_name=NASTY_CONFIG)
    assert text.startswith("#!/usr/bin/env bash\n") and "\nset -euo pipefail\n" in text
    assert plan.strategy.label() in text.split("set -euo pipefail")[0]
    launch_check.check_bash_syntax(text, "launch.sh")
    validate_launch_sh(text, plan)


def test_header_states_plan_and_batch_arithmetic():
    plan = ds_zero3_offload_4x8()
    header = render_launch_sh(plan).split("set -euo pipefail")[0]
    assert all(line.startswith("#") for line in header.strip().splitlines())
    assert "Global batch 128 samples = micro-batch 1 x accumulation 4 x dp 32" in header
    assert "4 node(s) x 8 process(es) = 32 = dp 32 x tp 1 x pp 1 x cp 1" in header


@needs_bash
@pytest.mark.parametrize(("given", "seen"), [
    ("8.0;9.0a;10.0f+PTX", "8.0;9.0;10.0+PTX"), ("7.5 9.0a", "7.5 9.0"), ("9.0", "9.0"), (None, "unset"),
])
def test_deepspeed_plans_strip_arch_suffixes_deepspeed_cannot_parse(tmp_path, given, seen):
    """The second H200 visit: that image's TORCH_CUDA_ARCH_LIST holds 9.0a, and DeepSpeed's JIT build of its
    FusedAdam died on int('0a'); launch.sh hands DeepSpeed plans the plain arch list (torch plans are left be)."""
    env = {"TORCH_CUDA_ARCH_LIST": given} if given is not None else {}
    result, _, _ = run_script(render_launch_sh(ds_zero2_1node()), tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert Path(f"{tmp_path / 'argv'}.env").read_bytes().split(b"\0")[1].decode() == f"TORCH_CUDA_ARCH_LIST={seen}"
    if given is not None:
        result, _, _ = run_script(render_launch_sh(fsdp_2nodes()), tmp_path, env=dict(env, MASTER_ADDR="n0"))
        assert result.returncode == 0, result.stderr
        assert Path(f"{tmp_path / 'argv'}.env").read_bytes().split(b"\0")[1].decode() == f"TORCH_CUDA_ARCH_LIST={given}"


@needs_bash
def test_single_node_torchrun_round_trip(tmp_path):
    plan = ds_zero2_1node()
    text = render_launch_sh(plan, train_script=NASTY, ds_config_name=NASTY_CONFIG)
    result, argv, _ = run_script(text, tmp_path, "--lr", "1e-4", "two words")
    assert result.returncode == 0, result.stderr
    static = launch_argv(text, env=static_env(tmp_path))
    assert argv == static + ["--lr", "1e-4", "two words"]  # the static reading is what bash runs
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(argv[1:])
    assert args.standalone and args.nnodes == "1" and args.nproc_per_node == "8"
    assert args.training_script == NASTY  # quoted through intact, nothing expanded
    assert args.training_script_args == ["--deepspeed", str(tmp_path / "export" / NASTY_CONFIG),
                                         "--lr", "1e-4", "two words"]
    launch_check.check_torchrun_argv(argv, plan)


@needs_bash
def test_multi_node_torchrun_round_trip(tmp_path):
    plan = ds_zero3_offload_4x8()
    text = render_launch_sh(plan)
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}
    result, argv, _ = run_script(text, tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert argv == launch_argv(text, env=static_env(tmp_path, **env))
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(argv[1:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("4", "8", "c10d")
    assert args.rdzv_endpoint == "10.0.0.1:6000" and args.rdzv_id == "optplan-llama-70b"
    assert not args.standalone
    before = dict(os.environ)
    parsed = launch_check.check_torchrun_argv(argv, plan)  # runs torchrun's config_from_args too
    assert parsed.training_script == "train.py"
    assert dict(os.environ) == before  # config_from_args' OMP_NUM_THREADS is undone


@needs_bash
def test_multi_node_needs_master_addr(tmp_path):
    result, argv, _ = run_script(render_launch_sh(fsdp_2nodes()), tmp_path)
    assert result.returncode == 2 and "MASTER_ADDR" in result.stderr and argv is None


@needs_bash
def test_environment_overrides(tmp_path):
    plan = ds_zero2_1node()
    text = render_launch_sh(plan)
    env = {"TRAIN_SCRIPT": "other.py", "DS_CONFIG": "/cfg/x.json"}
    result, argv, _ = run_script(text, tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert argv[-3:] == ["other.py", "--deepspeed", "/cfg/x.json"]
    assert argv == launch_argv(text, env=static_env(tmp_path, **env))


@needs_bash
def test_torch_plan_launches_script_only(tmp_path):
    plan = fsdp_2nodes()
    text = render_launch_sh(plan, train_script="fsdp_train.py")
    assert "ShardingStrategy.FULL_SHARD" in text and "LlamaDecoderLayer" in text and "accelerate launch" in text
    result, argv, _ = run_script(text, tmp_path, "--epochs", "1", env={"MASTER_ADDR": "n0"})
    assert result.returncode == 0, result.stderr
    assert argv[-3:] == ["fsdp_train.py", "--epochs", "1"] and "--deepspeed" not in argv


@needs_bash
def test_a_plan_of_a_shape_says_it_needs_a_training_script(tmp_path):
    """--arch/--params plans get no train.py (it builds the model from a model file): launch.sh says so in a note
    and stops at once, before any rank starts, unless TRAIN_SCRIPT names a script that exists."""
    plan = ds_zero2_1node().model_copy(update={"model_path": ""})
    text = render_launch_sh(plan)
    assert "made from --arch/--params, so optplan wrote no train.py" in text
    result, argv, _ = run_script(text, tmp_path)
    assert result.returncode == 2 and argv is None and "set TRAIN_SCRIPT" in result.stderr
    (tmp_path / "mine.py").write_text("")
    result, argv, _ = run_script(text, tmp_path, env={"TRAIN_SCRIPT": "mine.py"})
    assert result.returncode == 0 and argv is not None and "mine.py" in argv, result.stderr
    assert "wrote no train.py" not in render_launch_sh(ds_zero2_1node())  # a model file's plan: no such note


@needs_bash
def test_megatron_launch_round_trip(tmp_path):
    plan = megatron_16nodes()
    text = render_launch_sh(plan)
    checkout = tmp_path / "mlm"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("")
    env = {"MASTER_ADDR": "n0", "MEGATRON_LM": str(checkout)}
    result, argv, env_line = run_script(text, tmp_path, "--mock-data", env=env)
    assert result.returncode == 0, result.stderr
    assert env_line == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(argv[1:])
    assert args.training_script == str(checkout / "pretrain_gpt.py")
    assert args.training_script_args[-1] == "--mock-data"
    from optplan.planner.export.megatron import megatron_args, validate_megatron_args

    assert args.training_script_args[:-1] == megatron_args(plan)
    validate_megatron_args(args.training_script_args[:-1], plan)


@needs_bash
def test_megatron_launch_needs_checkout(tmp_path):
    text = render_launch_sh(megatron_16nodes())
    result, argv, _ = run_script(text, tmp_path, env={"MASTER_ADDR": "n0", "MEGATRON_LM": str(tmp_path / "none")})
    assert result.returncode == 2 and "MEGATRON_LM" in result.stderr and argv is None


@needs_bash
def test_deepspeed_launcher_multi_node_round_trip(tmp_path):
    plan = ds_zero2_2nodes()
    text = render_launch_sh(plan, launcher="deepspeed")
    hostfile = render_hostfile(plan, hosts=["gpu-a", "gpu-b"])
    result, argv, _ = run_script(text, tmp_path, "--seed", "1", program="deepspeed", files={"hostfile": hostfile})
    assert result.returncode == 0, result.stderr
    static = launch_argv(text, env=static_env(tmp_path, MASTER_ADDR="gpu-a"))
    assert argv == static + ["--seed", "1"]  # MASTER_ADDR defaults to the hostfile's first host
    runner = launch_check._import_ds_runner()
    args = runner.parse_args(argv[1:])
    assert (args.num_nodes, args.num_gpus, args.master_addr, args.master_port) == (2, 8, "gpu-a", 29500)
    assert args.hostfile == str(tmp_path / "export" / "hostfile")
    assert args.user_script == "train.py"
    assert args.user_args == ["--deepspeed", str(tmp_path / "export" / "ds_config.json"), "--seed", "1"]
    pool = runner.fetch_hostfile(args.hostfile)
    assert dict(pool) == {"gpu-a": 8, "gpu-b": 8}
    validate_launch_sh(text, plan, hostfile_text=hostfile)


@needs_bash
def test_deepspeed_launcher_needs_hostfile(tmp_path):
    result, argv, _ = run_script(render_launch_sh(ds_zero2_2nodes(), launcher="deepspeed"), tmp_path,
                                 program="deepspeed")
    assert result.returncode == 2 and "hostfile" in result.stderr and argv is None


@needs_bash
def test_deepspeed_launcher_single_node_round_trip(tmp_path):
    plan = ds_zero2_1node()
    text = render_launch_sh(plan, launcher="deepspeed")
    assert "--hostfile" not in text
    result, argv, _ = run_script(text, tmp_path, program="deepspeed")
    assert result.returncode == 0, result.stderr
    assert argv == launch_argv(text, env=static_env(tmp_path))
    args = launch_check._import_ds_runner().parse_args(argv[1:])
    assert (args.num_nodes, args.num_gpus, args.user_script) == (1, 8, "train.py")


def test_partial_node_plan_uses_its_gpu_count():
    plan = make_plan(Strategy(zero=1, mbs=2, grad_accum=2, dp=4))
    assert (plan.nodes, plan.procs_per_node) == (1, 4)
    text = render_launch_sh(plan)
    assert "--nproc-per-node 4" in text
    validate_launch_sh(text, plan)


def test_launched_command_is_shared_shape():
    command = launched_command(ds_zero2_1node())
    assert command.words == ('"$TRAIN_SCRIPT"', '--deepspeed "$DS_CONFIG"')
    assert launched_command(fsdp_2nodes()).words == ('"$TRAIN_SCRIPT"',)
    assert launched_command(megatron_16nodes()).words[0] == '"$MEGATRON_LM"/pretrain_gpt.py'


def test_client_optimizer_note_is_a_comment():
    text = render_launch_sh(make_plan(Strategy(zero=2, optimizer="adamw8bit", mbs=4, grad_accum=2, dp=8)))
    notes = [line for line in text.splitlines() if "bitsandbytes.optim.AdamW8bit" in line]
    assert notes and all(line.startswith("# NOTE: ") for line in notes)


# --------------------------------------------------------------------------------------------------
# Hostfile
# --------------------------------------------------------------------------------------------------


def test_hostfile_with_hosts_and_deepspeed_reader(tmp_path):
    plan = ds_zero3_offload_4x8()
    text = render_hostfile(plan, hosts=["a", "b", "c", "d"])
    assert "placeholder" not in text
    (tmp_path / "hostfile").write_text(text)
    pool = launch_check._import_ds_runner().fetch_hostfile(str(tmp_path / "hostfile"))
    assert list(pool.items()) == [("a", 8), ("b", 8), ("c", 8), ("d", 8)]


@pytest.mark.parametrize("hosts, match", [
    (["a"], "needs 2 node"),
    (["a", "a"], "twice"),
    (["a", "b c"], "not a plain host name"),
    (["a", "#b"], "not a plain host name"),
    ("ab", "not one string"),
])
def test_hostfile_bad_hosts(hosts, match):
    with pytest.raises(OptplanError, match=match):
        render_hostfile(ds_zero2_2nodes(), hosts=hosts)


# --------------------------------------------------------------------------------------------------
# Refusals and validation failures
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [fsdp_2nodes, megatron_16nodes])
def test_deepspeed_launcher_refuses_other_engines(make):
    with pytest.raises(NotExportable, match="use launcher torchrun"):
        render_launch_sh(make(), launcher="deepspeed")


@pytest.mark.parametrize("kw, match", [
    (dict(launcher="mpirun"), "unknown launcher"),
    (dict(train_script=""), "non-empty"),
    (dict(train_script="  "), "non-empty"),
    (dict(train_script="a\nb.py"), "control characters"),
    (dict(ds_config_name="configs/ds.json"), "plain file name"),
    (dict(ds_config_name=".."), "plain file name"),
    (dict(ds_config_name=""), "non-empty"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(OptplanError, match=match):
        render_launch_sh(ds_zero2_1node(), **kw)


def test_unexportable_megatron_plan():
    plan = make_plan(Strategy(engine="megatron", tp=8, pp=4, dp=4, mbs=1, grad_accum=16), shape=None)
    with pytest.raises(NotExportable, match="transformer"):
        render_launch_sh(plan)


@pytest.mark.parametrize("other", [
    lambda: ds_zero2_2nodes(),  # 16 GPUs, the script starts 8
    lambda: make_plan(Strategy(zero=2, mbs=4, grad_accum=2, dp=8), gpus_per_node=4),  # 2 nodes x 4
])
def test_validate_plan_mismatch(other):
    text = render_launch_sh(ds_zero2_1node())
    with pytest.raises(ExportValidationError, match="plan needs"):
        validate_launch_sh(text, other())


def test_validate_engine_mismatch():
    text = render_launch_sh(fsdp_2nodes())
    plan = make_plan(Strategy(zero=2, mbs=2, grad_accum=4, dp=16))  # same shape, DeepSpeed engine
    with pytest.raises(ExportValidationError, match="--deepspeed"):
        validate_launch_sh(text, plan)
    with pytest.raises(ExportValidationError, match="--deepspeed"):
        validate_launch_sh(render_launch_sh(plan), fsdp_2nodes())


@pytest.mark.parametrize("old, new, match", [
    ("--nproc-per-node 8", "--nproc-per-node 4", "plan needs"),
    ("--nnodes 4", "--nnodes 2:4", "elastic"),
    ("--rdzv-backend c10d", "--rdzv-backend static", "static rendezvous"),
    ("  --nnodes 4\n", "  --standalone\n  --nnodes 4\n", "standalone"),
    ("--nproc-per-node 8", "--nproc-per-node 8 --bogus-flag", "unrecognized arguments"),
    ('  "$TRAIN_SCRIPT"\n', "  $TRAIN_SCRIPT\n", "unquoted shell syntax"),
    ('--rdzv-id "$RDZV_ID"', '--rdzv-id "$NO_SUCH_VAR"', r"\$NO_SUCH_VAR"),
    ("LAUNCH=(", "ARGS=(", "LAUNCH=\\("),
    ("fi\n", "\n", "bash -n"),
])
def test_validate_tampered_torchrun_script(old, new, match):
    plan = ds_zero3_offload_4x8()
    text = render_launch_sh(plan)
    assert old in text
    with pytest.raises(ExportValidationError, match=match):
        validate_launch_sh(text.replace(old, new, 1), plan)


@pytest.mark.parametrize("old, new, match", [
    ("--num_gpus 8", "--num_gpus 4", "--num_gpus"),
    ("--num_nodes 2", "--num_nodes 3", "--num_nodes"),
    ('  --hostfile "$HOSTFILE"\n', "", "no --hostfile"),
    ("--num_gpus 8", "--num_gpus eight", "invalid int"),
])
def test_validate_tampered_deepspeed_script(old, new, match):
    plan = ds_zero2_2nodes()
    text = render_launch_sh(plan, launcher="deepspeed")
    assert old in text
    with pytest.raises(ExportValidationError, match=match):
        validate_launch_sh(text.replace(old, new, 1), plan)


@pytest.mark.parametrize("hostfile, match", [
    ("a slots=8\n", "1 host"),
    ("a slots=8\nb slots=4\n", "slots=4"),
    ("a slots=8\nb\n", "bad entry"),
    ("a slots=8\na slots=8\n", "multiple entries"),
])
def test_validate_bad_hostfile(hostfile, match):
    plan = ds_zero2_2nodes()
    with pytest.raises(ExportValidationError, match=match):
        validate_launch_sh(render_launch_sh(plan, launcher="deepspeed"), plan, hostfile_text=hostfile)


def test_validate_megatron_script_checks_megatron_rules():
    plan = megatron_16nodes()
    text = render_launch_sh(plan).replace("--num-query-groups 8", "--num-query-groups 4")
    with pytest.raises(ExportValidationError, match="num_query_groups"):
        validate_launch_sh(text, plan)


def test_validate_without_bash_warns_and_still_parses(monkeypatch):
    monkeypatch.setattr(launch_check, "_bash_path", lambda: None)
    plan = ds_zero2_1node()
    with pytest.warns(RuntimeWarning, match="bash is not installed"):
        validate_launch_sh(render_launch_sh(plan), plan)
    with pytest.warns(RuntimeWarning), pytest.raises(ExportValidationError, match="plan needs"):
        validate_launch_sh(render_launch_sh(plan), ds_zero2_2nodes())


def test_validate_empty_text():
    with pytest.raises(ExportValidationError, match="empty"):
        validate_launch_sh("", ds_zero2_1node())


def test_launch_argv_reads_comments_and_refuses_other_expansions():
    text = render_launch_sh(ds_zero2_1node())
    commented = text.replace("  --standalone\n", "  # rendezvous\n  --standalone\n")
    assert launch_argv(commented) == launch_argv(text)
    for bad, match in (('"$@"', "shell expansion"), ('"$(hostname)"', "shell expansion"), ("a;b", "unquoted"),
                       ("'open", "unterminated")):
        with pytest.raises(ExportValidationError, match=match):
            launch_argv(text.replace("  --standalone\n", f"  --standalone {bad}\n"))
    with pytest.raises(ExportValidationError, match="not closed"):
        launch_argv(text.replace("\n)\n", "\n"))


def test_the_fsdp_notes_name_the_plans_reduce_dtype() -> None:
    auto = render_launch_sh(make_plan(Strategy(engine="torch", fsdp="full", dp=8, precision="bf16")))
    assert "reduce_dtype=torch.float32" in auto and "reduce_dtype=torch.bfloat16" not in auto
    low = render_launch_sh(make_plan(Strategy(engine="torch", fsdp="full", dp=8, precision="bf16",
                                              fsdp_reduce_dtype="bf16")))
    assert "reduce_dtype=torch.bfloat16" in low and "reduce_dtype=torch.float32" not in low
    assert "FSDP gradient reduction in bf16" in low


def test_an_async_tp_plan_says_how_the_script_turns_it_on() -> None:
    plain = Strategy(engine="torch", fsdp="full", precision="bf16", tp=4, dp=2, sp=True, compile=True)
    fused = plain.model_copy(update={"async_tp": True})
    text = render_launch_sh(make_plan(fused))
    assert "_micro_pipeline_tp = True" in text and "enable_symm_mem_for_group" in text
    assert "_micro_pipeline_tp" not in render_launch_sh(make_plan(plain))
