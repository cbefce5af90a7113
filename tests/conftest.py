"""Shared fixtures: hand-built profiles and GPUs (tests/factories.py) so estimator and planner tests need no
torch. ``make_gpu``/``make_profile`` stay importable from here for the tests collected before tests/probes/."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import make_gpu, make_profile

from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.profile import ModelProfile

__all__ = ["make_gpu", "make_profile"]

HEAVY_FIRST = (
    "tests/benchmarks/test_gpu_campaign.py",  # 563 s: the CPU campaign, one module fixture
    "tests/planner/test_train_script.py",  # 458 s: 14 torchrun runs of train.py
    "tests/probes/test_adapters.py",  # 398 s
    "tests/probes/test_distributed_probe.py",  # 336 s
    "tests/planner/test_hf_timm.py",  # 255 s
    "tests/tui/test_cli.py",  # 238 s
    "tests/planner/test_finetune_cli.py",  # 212 s
    "tests/probes/test_runtime_probe.py",  # 209 s
    "tests/probes/test_moe_model_files.py",  # 202 s
    "tests/planner/test_moe_model_file_plan.py",  # 196 s
    "tests/reliability/test_ctrl_c.py",  # 187 s
    "tests/tui/test_cli_probe.py",  # 164 s
    "tests/probes/test_quant_inputs.py",  # 153 s
    "tests/probes/test_fidelity_tp_cpu.py",  # 143 s
    "tests/reliability/test_security.py",  # 135 s
    "tests/reliability/test_probe_faults.py",  # 124 s
    "tests/probes/test_static_profile.py",  # 119 s
    "tests/probes/test_model_loader_errors.py",  # 118 s
)
"""The slowest test files (seconds summed from `pytest --durations=0` with both workers, 2-core AVX2 VM whose CPU
emulates bf16, 2026-11-27, before that day's cuts), scheduled first: pyproject's ``--dist loadfile`` hands whole files to the 2 workers in collection order, so a heavy
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


_PROFILES: dict[tuple[Any, ...], ModelProfile] = {}
"""Profiles of model files already profiled in this worker (:func:`shared_profiles`)."""


@pytest.fixture
def shared_profiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process commands profile each (model file, options, ``OPTPLAN_*`` environment) once per worker.

    Profiling a model file is a child process that imports torch and runs ~36 fake-tensor steps (10-20 s on a
    2-core CI machine); the CLI tests run ``estimate``/``recommend`` on the same example files many times to
    check what the commands print, not the profiler (tests/probes/ checks that). Opt in per file with
    ``pytestmark = pytest.mark.usefixtures("shared_profiles")``. The key holds the file's bytes, so an edited
    file is profiled again; errors are not kept (each test sees its own). Commands run in a subprocess are not
    affected."""
    import optplan.planner.api as api

    real = api.profile_model_file

    def profile_once(path: str | os.PathLike[str], **kwargs: Any) -> ModelProfile:
        file = Path(path)
        content = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None
        env = tuple(sorted((k, v) for k, v in os.environ.items()
                           if k.startswith("OPTPLAN_") and k != "OPTPLAN_CACHE_DIR"))  # where calibrations go
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "cancelled"))
        key = (str(path), content, options, env)
        if content is None or key not in _PROFILES:
            profile = real(path, **kwargs)
            if content is None:
                return profile
            _PROFILES[key] = profile
        return _PROFILES[key]

    monkeypatch.setattr(api, "profile_model_file", profile_once)
    yield
