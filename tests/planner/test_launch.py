"""launch.sh: valid bash, quoted values, and a torchrun command line torchrun's own parser accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import Strategy
from optplan.planner.export.launch import render_launch_sh

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

NASTY = "my train's $HOME `id` \"x\".py"
NASTY_CONFIG = "ds config $(id).json"

FAKE_TORCHRUN = """#!/usr/bin/env bash
# records its arguments NUL-separated
: > "$ARGS_OUT"
for a in "$@"; do printf '%s\\0' "$a" >> "$ARGS_OUT"; done
"""


def plan(dp: int = 8, **kw) -> Strategy:
    return Strategy(precision="bf16", zero=2, mbs=4, grad_accum=2, dp=dp, **kw)


def bash_n(text: str, tmp_path: Path) -> None:
    script = tmp_path / "launch.sh"
    script.write_text(text)
    result = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def run_script(text: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """Run launch.sh with a fake torchrun first on PATH; return (result, torchrun argv or None)."""
    folder = tmp_path / "export"
    folder.mkdir(exist_ok=True)
    script = folder / "launch.sh"
    script.write_text(text)
    script.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "torchrun"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    args_out = tmp_path / "argv"
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NODEID", "TRAIN_SCRIPT", "DS_CONFIG")}
    full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", ARGS_OUT=str(args_out))
    full_env.update(env or {})
    result = subprocess.run([BASH, str(script), *args], capture_output=True, text=True, env=full_env,
                            cwd=tmp_path)
    argv = args_out.read_bytes().split(b"\0")[:-1] if args_out.exists() else None
    return result, None if argv is None else [a.decode() for a in argv]


def parse_torchrun(argv: list[str]):
    run = pytest.importorskip("torch.distributed.run")
    return run.get_args_parser().parse_args(argv), run


@pytest.mark.parametrize("nodes, gpus", [(1, 8), (2, 4), (4, 8)])
def test_bash_syntax(tmp_path, nodes, gpus):
    text = render_launch_sh(plan(dp=nodes * gpus), gpus_per_node=gpus, nodes=nodes,
                            ds_config_name=NASTY_CONFIG, train_script=NASTY)
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    bash_n(text, tmp_path)


def test_header_comments_describe_the_plan():
    s = plan(dp=8, offload_optimizer="cpu", checkpointing="full")
    text = render_launch_sh(s, gpus_per_node=8, nodes=1)
    header = text.split("set -euo pipefail")[0]
    assert all(line.startswith("#") for line in header.strip().splitlines())
    assert s.label() in header
    assert "global batch 64 = micro-batch 4 x accumulation 2 x 8 GPUs" in header
    assert "ZeRO stage 2" in header and "offload optimizer cpu" in header


def test_single_node_command(tmp_path):
    text = render_launch_sh(plan(dp=8), gpus_per_node=8, nodes=1, ds_config_name=NASTY_CONFIG, train_script=NASTY)
    result, argv = run_script(text, tmp_path, "--lr", "1e-4", "two words")
    assert result.returncode == 0, result.stderr
    args, run = parse_torchrun(argv)
    assert args.standalone and args.nnodes == "1" and args.nproc_per_node == "8"
    assert args.training_script == NASTY  # quoted through intact, nothing expanded
    assert args.training_script_args == ["--deepspeed", str(tmp_path / "export" / NASTY_CONFIG),
                                         "--lr", "1e-4", "two words"]


def test_multi_node_command(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it in os.environ otherwise
    text = render_launch_sh(plan(dp=16), gpus_per_node=8, nodes=2)
    env = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}
    result, argv = run_script(text, tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    args, run = parse_torchrun(argv)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert args.rdzv_backend == "static" and args.rdzv_endpoint == "10.0.0.1:6000"
    assert args.training_script == "train.py"
    assert args.training_script_args == ["--deepspeed", str(tmp_path / "export" / "ds_config.json")]
    config, _cmd, _cmd_args = run.config_from_args(args)  # torchrun's own resolution of the arguments
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert config.rdzv_configs["rank"] == 1 and config.rdzv_endpoint == "10.0.0.1:6000"


def test_multi_node_defaults(tmp_path):
    text = render_launch_sh(plan(dp=16), gpus_per_node=8, nodes=2)
    result, argv = run_script(text, tmp_path, env={"SLURM_NODEID": "0"})
    assert result.returncode == 0, result.stderr
    args, _ = parse_torchrun(argv)
    assert args.node_rank == 0 and args.rdzv_endpoint == "localhost:29500"


def test_multi_node_needs_node_rank_and_master_addr(tmp_path):
    text = render_launch_sh(plan(dp=16), gpus_per_node=8, nodes=2)
    result, argv = run_script(text, tmp_path)
    assert result.returncode == 2 and "NODE_RANK" in result.stderr and argv is None
    result, argv = run_script(text, tmp_path, env={"NODE_RANK": "1"})
    assert result.returncode == 2 and "MASTER_ADDR" in result.stderr and argv is None


def test_environment_overrides(tmp_path):
    text = render_launch_sh(plan(dp=8), gpus_per_node=8, nodes=1)
    result, argv = run_script(text, tmp_path, env={"TRAIN_SCRIPT": "other.py", "DS_CONFIG": "/cfg/x.json"})
    assert result.returncode == 0, result.stderr
    assert argv[-3:] == ["other.py", "--deepspeed", "/cfg/x.json"]


def test_notes_for_client_side_optimizer_are_comments(tmp_path):
    text = render_launch_sh(plan(dp=8, optimizer="adamw-8bit"), gpus_per_node=8, nodes=1)
    assert "# " in text and "bitsandbytes.optim.AdamW8bit" in text
    bash_n(text, tmp_path)


@pytest.mark.parametrize("gpus, nodes", [(8, 2), (4, 1)])
def test_gpu_count_must_match_plan(gpus, nodes):
    with pytest.raises(OptplanError, match="re-plan for"):
        render_launch_sh(plan(dp=8), gpus_per_node=gpus, nodes=nodes)


@pytest.mark.parametrize("kw", [dict(gpus_per_node=0, nodes=1), dict(gpus_per_node=8, nodes=0),
                                dict(gpus_per_node=8, nodes=1, train_script=""),
                                dict(gpus_per_node=8, nodes=1, ds_config_name=" ")])
def test_bad_arguments(kw):
    with pytest.raises(OptplanError):
        render_launch_sh(plan(dp=8), **kw)
