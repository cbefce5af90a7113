"""slurm.sbatch: golden files, valid bash, #SBATCH directives, and an srun/torchrun line that torch's own
parser accepts, read back statically and from a bash run with fake srun/scontrol on PATH."""

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
from optplan.planner.export.launch import RUNTIME_PLACEHOLDERS, launched_command, render_launch_sh
from optplan.planner.export.launch_check import launch_argv
from optplan.planner.export.slurm import parse_sbatch_directives, render_slurm_sbatch, validate_slurm_sbatch
from optplan.planner.validate import ExportValidationError

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="needs bash")
GOLDEN = Path(__file__).parent / "golden" / "slurm"
NASTY = "my train's $HOME `id` \"x\".py"

BUCKETS = DeepSpeedBuckets(reduce_bucket_size=16_777_216, allgather_bucket_size=16_777_216,
                           stage3_prefetch_bucket_size=15_099_494, stage3_param_persistence_threshold=40_960,
                           stage3_max_live_parameters=1_000_000_000)
LLAMA_70B = TransformerShape(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=128256, ffn=28672, gated=True)
LLAMA_8B = TransformerShape(hidden=4096, layers=32, heads=32, kv_heads=8, vocab=128256, ffn=14336, gated=True,
                            max_seq_len=8192)


def make_plan(strategy: Strategy, *, shape: TransformerShape | None = LLAMA_8B, model: str = "llama-8b",
              gpus_per_node: int = 8) -> ExportPlan:
    return ExportPlan(strategy=strategy, model=model, model_path="model.py", block_class="LlamaDecoderLayer",
                      params=8_030_261_248, transformer=shape, seq_len=4096, buckets=BUCKETS, gpu="H100-SXM",
                      gpus_per_node=gpus_per_node)


def ds_zero3_offload_4x8() -> ExportPlan:
    return make_plan(Strategy(precision="bf16", zero=3, mbs=1, grad_accum=4, dp=32, checkpointing="full",
                              offload_optimizer="cpu", offload_params="cpu"), shape=LLAMA_70B, model="llama-70b")


def fsdp_hybrid_2nodes() -> ExportPlan:
    return make_plan(Strategy(engine="torch", fsdp="hybrid", precision="bf16", mbs=2, grad_accum=4, dp=16,
                              checkpointing="selective"))


def megatron_16nodes() -> ExportPlan:
    return make_plan(Strategy(engine="megatron", tp=8, pp=4, vpp=2, dp=4, mbs=1, grad_accum=16),
                     shape=LLAMA_70B, model="llama-70b")


def single_node_partial() -> ExportPlan:
    return make_plan(Strategy(zero=1, mbs=2, grad_accum=2, dp=4))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("OPTPLAN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"missing golden file {path}: run the tests with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file (OPTPLAN_UPDATE_GOLDEN=1)"


GOLDEN_CASES = {
    "deepspeed_zero3_offload_4x8.sbatch": (ds_zero3_offload_4x8, dict(time_limit="2-00:00:00", partition="gpu")),
    "fsdp_hybrid_2nodes.sbatch": (fsdp_hybrid_2nodes, dict(job_name="fsdp-test")),
    "megatron_tp8_pp4_vpp2_16nodes.sbatch": (megatron_16nodes, dict(time_limit="04:00:00")),
    "deepspeed_zero1_1node_4gpus.sbatch": (single_node_partial, {}),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_and_valid(name):
    make, kw = GOLDEN_CASES[name]
    plan = make()
    text = render_slurm_sbatch(plan, **kw)
    check_golden(name, text)
    validate_slurm_sbatch(text, plan)


def test_directives():
    plan = ds_zero3_offload_4x8()
    ns, unknown = parse_sbatch_directives(render_slurm_sbatch(plan, time_limit="30", partition="a100,h100"))
    assert (ns.nodes, ns.ntasks_per_node, ns.gpus_per_node, ns.cpus_per_task) == ("4", 1, "8", 64)
    assert ns.exclusive == "exclusive" and ns.time == "30" and ns.partition == "a100,h100"
    assert ns.job_name == "optplan-llama-70b" and unknown == []
    partial, _ = parse_sbatch_directives(render_slurm_sbatch(single_node_partial(), cpus_per_task=16))
    assert partial.exclusive is None and partial.gpus_per_node == "4" and partial.cpus_per_task == 16


def test_same_launched_program_as_launch_sh():
    for plan in (ds_zero3_offload_4x8(), fsdp_hybrid_2nodes(), megatron_16nodes()):
        sbatch, launch_sh = render_slurm_sbatch(plan), render_launch_sh(plan)
        for word in launched_command(plan).words:
            assert f"\n  {word}\n" in sbatch and f"\n  {word}\n" in launch_sh
        program = launch_argv(launch_sh)
        program = program[program.index("--rdzv-id") + 2:]
        assert launch_argv(sbatch, env=dict(RUNTIME_PLACEHOLDERS, SLURM_NNODES="1"))[-len(program):] == program


def test_nccl_hints_are_comments():
    text = render_slurm_sbatch(ds_zero3_offload_4x8())
    hints = [line for line in text.splitlines() if "NCCL_SOCKET_IFNAME" in line or "NCCL_DEBUG" in line]
    assert hints and all(line.startswith("#") for line in hints)


def test_megatron_exports_cuda_device_max_connections():
    text = render_slurm_sbatch(megatron_16nodes())
    assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in text


# --------------------------------------------------------------------------------------------------
# Running the batch script with fake SLURM tools
# --------------------------------------------------------------------------------------------------

FAKE_SRUN = """#!/usr/bin/env bash
: > "$ARGS_OUT"
for a in "$@"; do printf '%s\\0' "$a" >> "$ARGS_OUT"; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" && -n "${3:-}" ]] || exit 1
printf 'gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n'
"""


def run_sbatch(text: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """Run the batch script as SLURM would (from a spool copy, in the submit folder)."""
    submit = tmp_path / "submit"
    spool = tmp_path / "spool"
    bin_dir = tmp_path / "bin"
    for folder in (submit, spool, bin_dir):
        folder.mkdir(exist_ok=True)
    (spool / "slurm_script").write_text(text)
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    args_out = tmp_path / "argv"
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in ("TRAIN_SCRIPT", "DS_CONFIG", "MASTER_PORT", "MEGATRON_LM")}
    full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", ARGS_OUT=str(args_out),
                    SLURM_NNODES="4", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-[a-d]", SLURM_CPUS_PER_TASK="64",
                    SLURM_SUBMIT_DIR=str(submit))
    full_env.update(env or {})
    result = subprocess.run([BASH, str(spool / "slurm_script"), *args], capture_output=True, text=True,
                            env=full_env, cwd=submit, timeout=30)
    argv = [a.decode() for a in args_out.read_bytes().split(b"\0")[:-1]] if args_out.exists() else None
    return result, argv


@needs_bash
def test_multi_node_round_trip(tmp_path):
    plan = ds_zero3_offload_4x8()
    text = render_slurm_sbatch(plan, train_script=NASTY)
    result, argv = run_sbatch(text, tmp_path, "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert argv[:3] == ["--ntasks-per-node=1", "--cpus-per-task=64", "--kill-on-bad-exit=1"]
    torchrun_argv = argv[3:]
    env = dict(RUNTIME_PLACEHOLDERS, SLURM_NNODES="4", SLURM_JOB_ID="4242", head="gpu-a",
               SCRIPT_DIR=str(tmp_path / "submit"))
    assert torchrun_argv == launch_argv(text, env=env) + ["--seed", "3"]
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(torchrun_argv[1:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("4", "8", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id) == ("gpu-a:29500", "4242")
    assert args.training_script == NASTY
    assert args.training_script_args == ["--deepspeed", str(tmp_path / "submit" / "ds_config.json"), "--seed", "3"]
    launch_check.check_torchrun_argv(torchrun_argv, plan, what="slurm.sbatch")


@needs_bash
def test_megatron_round_trip(tmp_path):
    plan = megatron_16nodes()
    text = render_slurm_sbatch(plan)
    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text("")
    result, argv = run_sbatch(text, tmp_path, env={"SLURM_NNODES": "16", "MEGATRON_LM": str(checkout)})
    assert result.returncode == 0, result.stderr
    launch_check.check_torchrun_argv(argv[3:], plan, what="slurm.sbatch")  # Megatron rules included


@needs_bash
def test_needs_a_node_list(tmp_path):
    result, argv = run_sbatch(render_slurm_sbatch(fsdp_hybrid_2nodes()), tmp_path, env={"SLURM_JOB_NODELIST": ""})
    assert argv is None and result.returncode == 2 and "scontrol named no node" in result.stderr


# --------------------------------------------------------------------------------------------------
# Refusals and validation failures
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(job_name="my job"), "job name"),
    (dict(job_name=""), "job name"),
    (dict(time_limit="soon"), "time limit"),
    (dict(partition="gpu a"), "partition"),
    (dict(cpus_per_task=4), "cpus per task"),
    (dict(train_script=""), "non-empty"),
    (dict(ds_config_name="a/b.json"), "plain file name"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(OptplanError, match=match):
        render_slurm_sbatch(ds_zero3_offload_4x8(), **kw)


def test_unexportable_plan():
    plan = make_plan(Strategy(engine="megatron", tp=8, pp=4, dp=4, mbs=1, grad_accum=16, optimizer="adafactor"))
    with pytest.raises(NotExportable, match="adafactor"):
        render_slurm_sbatch(plan)


@pytest.mark.parametrize("old, new, match", [
    ("#SBATCH --nodes=4", "#SBATCH --nodes=2", "set --nodes=4"),
    ("#SBATCH --nodes=4", "#SBATCH --nodes=2-4", "fixed count"),
    ("#SBATCH --ntasks-per-node=1", "#SBATCH --ntasks-per-node=8", "--ntasks-per-node=1"),
    ("#SBATCH --gpus-per-node=8", "#SBATCH --gpus-per-node=h100:4", "4 GPU"),
    ("#SBATCH --gpus-per-node=8", "#SBATCH --gres=gpu:h100:8", None),
    ("#SBATCH --gpus-per-node=8", "#SBATCH --mem=0", "no GPUs"),
    ("#SBATCH --cpus-per-task=64", "#SBATCH --cpus-per-task=2", "cpus-per-task"),
    ("#SBATCH --nodes=4\n", "", "no #SBATCH --nodes"),
    ("--nproc-per-node 8", "--nproc-per-node 4", "plan needs"),
    ('--rdzv-id "$SLURM_JOB_ID"', "--rdzv-id none", "rdzv-id"),
    ("srun --ntasks", "echo --ntasks", "srun"),
    ('  "$TRAIN_SCRIPT"\n  --deepspeed "$DS_CONFIG"\n', '  "$TRAIN_SCRIPT"\n', "--deepspeed"),
    ("fi\n", "\n", "bash -n"),
])
def test_validate_tampered(old, new, match):
    plan = ds_zero3_offload_4x8()
    text = render_slurm_sbatch(plan)
    assert old in text
    tampered = text.replace(old, new, 1)
    if match is None:
        validate_slurm_sbatch(tampered, plan)
        return
    with pytest.raises(ExportValidationError, match=match):
        validate_slurm_sbatch(tampered, plan)


def test_directive_after_a_command_is_reported():
    text = render_slurm_sbatch(ds_zero3_offload_4x8()).replace("set -euo pipefail\n",
                                                               "set -euo pipefail\n#SBATCH --nodes=8\n")
    with pytest.raises(ExportValidationError, match="after the first command"):
        validate_slurm_sbatch(text, ds_zero3_offload_4x8())


def test_validate_plan_mismatch():
    with pytest.raises(ExportValidationError, match="plan needs"):
        validate_slurm_sbatch(render_slurm_sbatch(fsdp_hybrid_2nodes()), megatron_16nodes())
    with pytest.raises(ExportValidationError, match="num_query_groups"):
        plan = megatron_16nodes()
        validate_slurm_sbatch(render_slurm_sbatch(plan).replace("--num-query-groups 8", "--num-query-groups 4"), plan)


def test_validate_without_bash_warns(monkeypatch):
    monkeypatch.setattr(launch_check, "_bash_path", lambda: None)
    plan = fsdp_hybrid_2nodes()
    with pytest.warns(RuntimeWarning, match="skipped the 'bash -n' syntax check of slurm.sbatch"):
        validate_slurm_sbatch(render_slurm_sbatch(plan), plan)
