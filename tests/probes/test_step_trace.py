"""probes/step_trace.py: kernel and operator names sorted into the step-time model's parts."""

from __future__ import annotations

import pytest

from optplan.probes.step_trace import NAME_CHARS, category, host_time, sum_events, top_kernels


@pytest.mark.parametrize(("name", "want"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "gemm"),
    ("aten::addmm", "gemm"),
    ("aten::mm", "gemm"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("aten::add", "other"),
    ("aten::mul_", "other"),
])
def test_names_fall_in_the_right_part(name: str, want: str) -> None:
    assert category(name) == want


class _Range:
    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end


class _Event:
    def __init__(self, name: str, device: str, us: float, *, annotation: bool | None = False) -> None:
        from torch.autograd import DeviceType

        self.name = name
        self.device_type = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
        self.time_range = _Range(0.0, us)
        self.self_cpu_time_total = us
        self.cpu_time_total = us
        if annotation is not None:
            self.is_user_annotation = annotation


def test_device_annotations_are_not_kernels() -> None:
    """Kineto copies record_function ranges onto the GPU timeline; AdamW's step span covers its own kernels,
    so counting it doubled the optimizer's time on the first H200 trace."""
    kernels = [_Event("multi_tensor_apply_kernel<AdamFunctor>", "cuda", 300.0),
               _Event("multi_tensor_apply_kernel<AdamFunctor>", "cuda", 200.0),
               _Event("sm90_xmma_gemm_bf16", "cuda", 1000.0),
               _Event("aten::mm", "cpu", 50.0)]
    span = _Event("Optimizer.step#AdamW.step", "cuda", 520.0, annotation=True)
    unflagged = _Event("ProfilerStep#3", "cuda", 2000.0, annotation=None)  # a torch without the flag
    sums, count, skipped = sum_events([*kernels, span, unflagged], cuda=True)
    assert sums["optimizer"] == pytest.approx(500e-6) and sums["gemm"] == pytest.approx(1000e-6)
    assert (count, skipped) == (3, 2)


def test_cpu_operators_use_self_time_and_the_optimizer_range() -> None:
    events = [_Event("aten::mm", "cpu", 40.0), _Event("aten::mul_", "cpu", 30.0),
              _Event("Optimizer.step#AdamW.step", "cpu", 25.0), _Event("sm90_gemm", "cuda", 99.0)]
    sums, count, skipped = sum_events(events, cuda=False)
    assert sums["gemm"] == pytest.approx(40e-6) and sums["optimizer"] == pytest.approx(25e-6)
    assert sums["other"] == pytest.approx(5e-6) and (count, skipped) == (2, 0)


def test_host_side_sums_operators_launches_and_waits() -> None:
    events = [_Event("aten::mm", "cpu", 12.0), _Event("aten::add_", "cpu", 8.0), _Event("cudaLaunchKernel", "cpu", 5.0),
              _Event("cudaStreamSynchronize", "cpu", 300.0), _Event("sm90_gemm", "cuda", 99.0),
              _Event("Optimizer.step#AdamW.step", "cpu", 400.0)]
    host = host_time(events)
    assert host["aten_self_s"] == pytest.approx(20e-6) and host["ops"] == 2
    assert host["cuda_runtime_s"] == pytest.approx(5e-6) and host["sync_s"] == pytest.approx(300e-6)


def test_top_kernels_name_where_the_time_went_per_step() -> None:
    """The trace names its longest kernels (which SDPA backend ran: flash or cuDNN), per step, longest first."""
    long_name = "void cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128" + "<T>" * 100
    events = [_Event("sm90_xmma_gemm_bf16", "cuda", 300.0), _Event("sm90_xmma_gemm_bf16", "cuda", 300.0),
              _Event(long_name, "cuda", 500.0), _Event("elementwise_kernel<add>", "cuda", 100.0),
              _Event("Optimizer.step#AdamW.step", "cuda", 900.0, annotation=True), _Event("aten::mm", "cpu", 40.0)]
    top = top_kernels(events, cuda=True, steps=2, n=2)
    assert [t["category"] for t in top] == ["gemm", "attention"]
    assert top[0]["s"] == pytest.approx(300e-6) and top[0]["calls"] == 1.0  # 600 µs over 2 steps
    assert top[1]["name"] == long_name[:NAME_CHARS] and top[1]["s"] == pytest.approx(250e-6)
    cpu = top_kernels(events, cuda=False)
    assert cpu == [{"name": "aten::mm", "category": "gemm", "s": pytest.approx(40e-6), "calls": 1.0}]
