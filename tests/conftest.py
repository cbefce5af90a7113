"""Shared fixtures: hand-built profiles and GPUs (tests/factories.py) so estimator and planner tests need no
torch. ``make_gpu``/``make_profile`` stay importable from here for the tests collected before tests/probes/."""

from __future__ import annotations

import pytest
from factories import make_gpu, make_profile

from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.profile import ModelProfile

__all__ = ["make_gpu", "make_profile"]

HEAVY_FIRST = (
    "tests/benchmarks/test_gpu_campaign.py",  # 174 s: the CPU campaign, one module fixture
    "tests/planner/test_train_script.py",  # 144 s: 14 torchrun runs of train.py
    "tests/probes/test_distributed_probe.py",  # 137 s
    "tests/reliability/test_ctrl_c.py",  # 95 s
    "tests/probes/test_adapters.py",  # 86 s
    "tests/reliability/test_probe_faults.py",  # 81 s
    "tests/probes/test_runtime_probe.py",  # 81 s
    "tests/planner/test_finetune_cli.py",  # 78 s
    "tests/tui/test_cli.py",  # 75 s
    "tests/tui/test_cli_probe.py",  # 69 s
    "tests/planner/test_moe_model_file_plan.py",  # 63 s
    "tests/probes/test_fidelity_tp_cpu.py",  # 59 s
    "tests/probes/test_model_loader_errors.py",  # 59 s
    "tests/probes/test_quant_inputs.py",  # 53 s
    "tests/reliability/test_security.py",  # 52 s
)
"""The slowest test files (seconds measured one at a time, `pytest --durations=0`, 2-core VM, 2026-11-26),
scheduled first: pyproject's ``--dist loadfile`` hands whole files to the 2 workers in collection order, so a heavy
file collected last would leave one worker running it alone at the end (20.9 min with the default order). An order
hint only: a file missing here still runs, later."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the files of :data:`HEAVY_FIRST` to the front, heaviest first; every file's own order is kept."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.path.relative_to(config.rootpath).as_posix()
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the rest keep pytest's order


@pytest.fixture
def gpu() -> GPUSpec:
    return make_gpu()


@pytest.fixture
def profile() -> ModelProfile:
    return make_profile()


@pytest.fixture
def cluster8(gpu: GPUSpec) -> Cluster:
    return Cluster(gpu=gpu, gpus=8, gpus_per_node=8)
