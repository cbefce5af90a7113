"""Shared fixtures: hand-built profiles and GPUs (tests/factories.py) so estimator and planner tests need no
torch. ``make_gpu``/``make_profile`` stay importable from here for the tests collected before tests/probes/."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from factories import make_gpu, make_profile

from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.profile import ModelProfile
from optplan.probes.profile_cache import PROFILE_CACHE_ENV

__all__ = ["make_gpu", "make_profile"]

HEAVY_FIRST = (
    "tests/probes/test_distributed_probe.py",  # 184 s
    "tests/planner/test_finetune_cli.py",  # 181 s
    "tests/planner/test_train_script.py",  # 160 s
    "tests/probes/test_runtime_probe.py",  # 140 s
    "tests/probes/test_moe_model_files.py",  # 136 s
    "tests/tui/test_cli.py",  # 130 s
    "tests/planner/test_hf_source.py",  # 130 s
    "tests/benchmarks/test_gpu_campaign.py",  # 125 s
    "tests/probes/test_adapters.py",  # 120 s
    "tests/probes/test_model_loader_errors.py",  # 93 s
    "tests/probes/test_static_profile.py",  # 91 s
    "tests/reliability/test_probe_faults.py",  # 86 s
    "tests/probes/test_device_lock.py",  # 85 s
    "tests/reliability/test_ctrl_c.py",  # 84 s
    "tests/planner/test_finetune_full_export.py",  # 79 s
    "tests/reliability/test_security.py",  # 74 s
    "tests/planner/test_search.py",  # 70 s
    "tests/tui/test_cli_probe.py",  # 70 s
    "tests/reliability/test_bad_input.py",  # 69 s
    "tests/reliability/test_interruptions.py",  # 67 s
    "tests/probes/test_profile_cache.py",  # 58 s
    "tests/probes/test_cpu_accounting.py",  # 50 s
)
"""The slowest test files of the default run (seconds summed from `pytest --durations=0` with both workers on a
2-core AVX2 VM whose CPU emulates bf16 matmuls at ~1 GFLOP/s, 2026-12-03, the ``full`` tests left out: see
pyproject's markers), scheduled first: pyproject's ``--dist loadfile`` hands whole files to the 2 workers in
collection order, so a heavy file collected last would leave one worker running it alone at the end. An order hint
only: a file missing here still runs, later."""


def _session_profile_cache() -> None:
    """One profile cache for the whole run, shared by the xdist workers (they inherit this process's environment)
    and by the commands tests start: each model file is profiled once per run (probes/profile_cache.py keys on what
    the profile read, so an edited file is profiled again), however many tests set their own OPTPLAN_CACHE_DIR.
    A cache the developer named (``OPTPLAN_PROFILE_CACHE``, ``off`` included) is kept."""
    if PROFILE_CACHE_ENV not in os.environ:
        folder = tempfile.mkdtemp(prefix="optplan-test-profiles-")
        os.environ[PROFILE_CACHE_ENV] = folder
        if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller made it: it removes it at exit
            atexit.register(shutil.rmtree, folder, ignore_errors=True)


_session_profile_cache()


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
