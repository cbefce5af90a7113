"""cuBLAS's workspaces in the allocated bytes of a CUDA step (estimators/library_workspaces.py): measured as the
64.00 MiB that every single-process torch run of the Llama-3 1B layout held above the prediction on an H200
(benchmarks/results/2026-11-26-H200), and absent from a CPU step."""

from __future__ import annotations

from optplan.estimators.hardware import gpu_catalogue
from optplan.estimators.library_workspaces import cublas_workspace_bytes, library_workspaces
from optplan.estimators.memory import memory_breakdown
from optplan.estimators.strategy import Strategy
from tests.factories import make_profile

MIB = 2**20
CAP = 80 * 2**30


def test_hopper_holds_two_32_mib_workspaces_and_other_gpus_two_of_the_default() -> None:
    assert cublas_workspace_bytes("H200") == cublas_workspace_bytes("H100-SXM") == 64 * MIB
    assert cublas_workspace_bytes("A100-80GB") == 2 * (2 * 4096 + 8 * 16) * 1024
    assert cublas_workspace_bytes(None) == cublas_workspace_bytes("A100-80GB")
    assert set(library_workspaces().cublas.large_gpus) <= set(gpu_catalogue())  # every name is a catalogue GPU


def test_a_cuda_step_allocates_the_workspaces_at_every_moment_and_a_cpu_step_none() -> None:
    profile = make_profile()
    for strategy in (Strategy(precision="bf16", mbs=2), Strategy(precision="amp-bf16", mbs=4, checkpointing="full"),
                     Strategy(precision="fp32", mbs=1, engine="deepspeed", zero=3, dp=8)):
        gpu = memory_breakdown(profile, strategy, CAP, gpu="H200")
        cpu = memory_breakdown(profile, strategy, CAP, device="cpu")
        assert gpu.detail_bytes["cublas_workspaces"] == 64 * MIB
        assert "cublas_workspaces" not in cpu.detail_bytes
        unknown = memory_breakdown(profile, strategy, CAP)
        assert (gpu.total_bytes - gpu.overhead_bytes) - (unknown.total_bytes - unknown.overhead_bytes) \
            == 64 * MIB - cublas_workspace_bytes(None)
