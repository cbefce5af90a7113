"""Shared fixtures: hand-built profiles and GPUs (tests/factories.py) so estimator and planner tests need no
torch. ``make_gpu``/``make_profile`` stay importable from here for the tests collected before tests/probes/."""

from __future__ import annotations

import pytest
from factories import make_gpu, make_profile

from optplan.estimators.hardware import Cluster, GPUSpec
from optplan.estimators.profile import ModelProfile

__all__ = ["make_gpu", "make_profile"]


@pytest.fixture
def gpu() -> GPUSpec:
    return make_gpu()


@pytest.fixture
def profile() -> ModelProfile:
    return make_profile()


@pytest.fixture
def cluster8(gpu: GPUSpec) -> Cluster:
    return Cluster(gpu=gpu, gpus=8, gpus_per_node=8)
