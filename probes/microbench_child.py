"""Microbenchmark child: this machine's achieved matmul FLOP/s, copy bandwidth and all-reduce bus bandwidth.

Run by :mod:`optplan.probes.microbench` in a fresh process; usable on its own in a bare GPU environment
(it imports only the standard library and torch, never pydantic or the rest of optplan):

    python -m optplan.probes.microbench_child --out RESULT.json [--device auto|cpu|cuda] [--quick]
                                              [--dtypes fp32,tf32,bf16,fp16,fp8]
    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m optplan.probes.microbench_child --allreduce --out RESULT.json [--device ...] [--quick]

(``python probes/microbench_child.py ...`` works the same.) The result is ONE JSON object written to
``--out`` (a temporary file, then renamed, so a reader never sees half a file); failures print a last
stderr line ``microbench_child: error: ...`` and exit with code 1.

What is measured (units: FLOP/s, bytes/s, bytes, seconds)
- Matmul: square n × n GEMMs per dtype (dtype names as in ``optplan.estimators.hardware.Dtype``), FLOPs
  = 2·n³ per GEMM (n³ multiply-adds). n = 8192 on CUDA (4096 with ``--quick``): large and aligned, so
  cuBLAS runs its full-wave kernels (the time model's "large aligned GEMM"); 1024 on CPU (512 quick).
  fp32 runs with TF32 disabled (``torch.backends.cuda.matmul.allow_tf32 = False``: the CUDA-core SGEMM
  the catalogue's fp32 peak describes), tf32 with it enabled (CUDA only), bf16/fp16 as half-precision
  GEMMs, fp8 (e4m3 × e4m3 → bf16, per-tensor scales, full-precision accumulation) through
  ``torch._scaled_mm`` only on GPUs of compute capability >= 8.9. A dtype the device cannot run is
  left out of the result (listed under ``matmul_skipped`` with the reason), never an error. Where fp8 ran, the
  same GEMM again with fast accumulation (``use_fast_accum=True``: the accumulator is not promoted to fp32 in
  between, as Transformer Engine runs its forward GEMMs; its gradient GEMMs run split accumulation, as the first
  figure), under ``matmul_fast_accum_flops_per_s``.
- Unaligned GEMMs (``unaligned_gemm_slowdown`` per dtype, bf16/fp16/fp32 on CUDA, fp32 on CPU): the three GEMMs
  of a linear layer's training step (forward Y = X·Wᵀ, data gradient dY·W, weight gradient dYᵀ·X) of a
  language-model head, m tokens × k hidden × n vocabulary (CUDA: 8192 × 2048 × 50,304, quick 4096; CPU:
  256 × 256 × 2,048), once with n padded (50,304 = 393 · 128) and once with the odd n - 1 (50,303: like GPT-2's
  unpadded 50,257, every row of Y is 2 bytes aligned in 16-bit, 4 in fp32). The figure is the unaligned time per
  FLOP over the aligned one. Tensor-core kernels load 16-byte vectors (Hopper's TMA needs 16-byte strides): an
  odd dimension makes cuBLAS fall back to narrow-load kernels (NVIDIA Deep Learning Performance Guide, "Matrix
  Multiplication Background", "Tensor Core Requirements"). The time model prices this as (a/16)^-γ with a the
  alignment in bytes (estimators/compute.py ``gemm_time_s``), so γ = ln(slowdown) / ln(16/a)
  (estimators/ceilings.py ``alignment_exponent_from``).
- Attention (``attention_flops_per_s``): causal ``torch.nn.functional.scaled_dot_product_attention`` forward and
  backward by backend (torch's own pick, then FlashAttention-2 and cuDNN forced with ``torch.nn.attention.sdpa_kernel``;
  a backend this device or torch lacks is listed under ``attention_skipped``) and sequence length (CUDA: 4k-64k,
  quick 2k-32k; 16 heads of 128, bf16, about 64k tokens per call), FLOPs
  counted as FlashAttention's benchmarks count them (Dao 2023, arXiv 2307.08691 §4.1: forward 4·b·h·s²·d, halved
  under the causal mask; backward 2.5x the forward; each pass timed alone): the fractions estimators/data/attention_kernels.yaml holds,
  measured on this machine's stack at the sequence lengths long-context plans run.
- Copy bandwidth: ``dst.copy_(src)`` of a large device buffer (1 GiB on CUDA, 256 MiB quick; 256 MiB
  on CPU, 64 MiB quick; a server CPU's last-level cache can hold that much, so a CPU figure may be
  partly cache bandwidth: CPU runs are for tests, GPUs' L2 is ≤ ~100 MB). Bytes moved = 2 × size per copy (bytes
  read + bytes written), the STREAM "Copy" convention (J. D. McCalpin, STREAM benchmark reference,
  "Counting Bytes and FLOPS", https://www.cs.virginia.edu/stream/ref.html; BabelStream counts Copy the
  same way), which is what a datasheet's HBM bandwidth (reads + writes) is compared with.
- All-reduce bus bandwidth (``--allreduce``, one process per device under torchrun; gloo on CPU, NCCL
  on CUDA): float32 all-reduces of several sizes, algbw = size / time and busbw = algbw · 2(n−1)/n, the
  definition of NVIDIA nccl-tests (doc/PERFORMANCE.md, "Bus bandwidth", AllReduce: a ring all-reduce
  moves 2(n−1)/n · size per rank, so busbw is comparable with the link's one-way bandwidth whatever n).
  The time of one all-reduce is the slowest rank's (a collective ends when its last rank does). The
  largest size's busbw is the result; every size's is kept in ``allreduce_bus_bytes_per_s_by_size``.
  Rank 0 writes the file.

Timing: warm-up (cuBLAS/oneDNN kernel selection, allocator, clocks), then R repeats (5; 3 with
``--quick``) of k back-to-back operations, k chosen so one repeat lasts ~0.2 s (~0.05 s quick), bracketed
by ``torch.cuda.synchronize()`` and ``time.perf_counter()`` on CUDA. The BEST repeat is reported: a
ceiling is what the hardware can do, and interference (other processes, OS scheduling, clock ramp-up)
only ever makes a repeat slower; it is also how the references define their figures (STREAM reports the
best of its repetitions; the A100 GEMM fraction the time model is fitted against is bounded by the
maximum achieved matmul FLOP/s, Bekman, "Machine Learning Engineering", Maximum Achievable Matmul
FLOPS). The median is kept beside it (``*_median``) to show the spread. A GPU that throttles under
sustained load runs a long training job somewhat below these bursts.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()

from optplan.probes._safe_path import drop_working_folder  # noqa: E402

drop_working_folder()  # before torch: no stray numpy.py from the working folder (Python 3.10)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
CPU_DTYPES = ("fp32", "bf16", "fp16")
ERROR_PREFIX = "microbench_child: error:"
MIB = 2**20
GIB = 2**30

# (normal, quick) sizes per device
MATMUL_N = {"cuda": (8192, 4096), "cpu": (1024, 512)}
UNALIGNED_SHAPE = {"cuda": ((8192, 2048, 50304), (4096, 2048, 50304)), "cpu": ((256, 256, 2048), (128, 256, 2048))}
"""(m tokens, k hidden, n padded vocabulary) of the unaligned-GEMM measurement per device, (normal, quick)."""
UNALIGNED_DTYPES = {"cuda": ("bf16", "fp16", "fp32"), "cpu": ("fp32",)}
COPY_BYTES = {"cuda": (GIB, 256 * MIB), "cpu": (256 * MIB, 64 * MIB)}
ALLREDUCE_BYTES = {"cuda": ((16 * MIB, 128 * MIB, GIB), (8 * MIB, 64 * MIB, 256 * MIB)),
                   "cpu": ((MIB, 16 * MIB, 64 * MIB), (256 * 1024, MIB, 4 * MIB))}
ATTENTION_SEQS = {"cuda": ((4096, 16384, 32768, 65536), (2048, 8192, 32768)), "cpu": ((128, 256), (128,))}
"""Sequence lengths of the attention measurement per device, (normal, quick)."""
ATTENTION_TOKENS = {"cuda": (65536, 32768), "cpu": (256, 128)}
"""Tokens per call (batch × sequence; at least one sequence) per device, (normal, quick)."""
ATTENTION_HEADS, ATTENTION_HEAD_DIM = {"cuda": 16, "cpu": 2}, 128
ATTENTION_BACKENDS = ("default", "flash", "cudnn")
"""torch SDPA as it picks by itself, then FlashAttention-2 and cuDNN forced (``torch.nn.attention.sdpa_kernel``)."""
REPEATS = (5, 3)
REPEAT_TARGET_S = (0.2, 0.05)
WARMUP = 2


class Unsupported(Exception):
    """The device cannot run this benchmark (the dtype is left out of the result)."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m optplan.probes.microbench_child",
                                     description="Measure matmul FLOP/s, copy bandwidth and all-reduce bus "
                                                 "bandwidth; writes one JSON object to --out.")
    parser.add_argument("--out", required=True, help="result JSON path (written atomically)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--dtypes", default=None,
                        help=f"comma-separated subset of {','.join(DTYPES)} (default: all the device has)")
    parser.add_argument("--allreduce", action="store_true",
                        help="measure all-reduce bus bandwidth (run under torchrun, one process per device)")
    args = parser.parse_args(argv)
    if args.dtypes is not None:
        wanted = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        unknown = [d for d in wanted if d not in DTYPES]
        if unknown or not wanted:
            parser.error(f"--dtypes: unknown {','.join(unknown) or '(empty)'}; use a subset of {','.join(DTYPES)}")
        args.dtypes = wanted
    return args


def _device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}): run with --device cpu or on a GPU machine")
    return requested


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"{_cpu_name()} ({torch.get_num_threads()} threads)"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_op(op: Callable[[], object], device: str, quick: bool) -> list[float]:
    """Seconds per call of ``op``, one figure per repeat (module docstring: warm-up, R repeats of k calls)."""
    for _ in range(WARMUP):
        op()
    _sync(device)
    t0 = time.perf_counter()
    op()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    k = max(1, math.ceil(REPEAT_TARGET_S[quick] / one))
    times = []
    for _ in range(REPEATS[quick]):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(k):
            op()
        _sync(device)
        times.append((time.perf_counter() - t0) / k)
    return times


def _set_tf32(enabled: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = enabled


def _matmul_op(dtype: str, n: int, device: str, *, fast_accum: bool = False) -> Callable[[], object]:
    """The GEMM for ``dtype`` (raises Unsupported when the device has no such math); ``fast_accum``: fp8's
    accumulation without fp32 promotion."""
    if dtype in ("tf32", "fp8") and device != "cuda":
        raise Unsupported(f"{dtype} is a CUDA tensor-core format")
    gen = torch.Generator(device=device).manual_seed(0)
    if dtype == "fp8":
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            raise Unsupported(f"torch {torch.__version__} has no torch._scaled_mm")
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            raise Unsupported(f"compute capability {cap[0]}.{cap[1]} < 8.9 has no fp8 tensor cores")
        a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device=device, dtype=torch.float32)

        def fp8() -> object:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)

        return fp8
    tdtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if device == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise Unsupported("this GPU has no bf16 math")
    a = torch.randn(n, n, device=device, generator=gen).to(tdtype)
    b = torch.randn(n, n, device=device, generator=gen).to(tdtype)
    out = torch.empty(n, n, device=device, dtype=tdtype)

    def mm() -> object:
        return torch.mm(a, b, out=out)

    return mm


def measure_matmul(device: str, dtypes: list[str], quick: bool) -> dict[str, Any]:
    """Achieved GEMM FLOP/s per dtype (best and median repeat) and the dtypes left out, with why."""
    n = MATMUL_N[device][quick]
    best: dict[str, float] = {}
    median: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for dtype in dtypes:
        try:
            if device == "cuda":
                _set_tf32(dtype == "tf32")
            op = _matmul_op(dtype, n, device)
            op()  # an unsupported kernel fails here
            times = _time_op(op, device, quick)
        except Unsupported as exc:
            skipped[dtype] = str(exc)
            continue
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # no kernel for this dtype here
            skipped[dtype] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            continue
        finally:
            if device == "cuda":
                _set_tf32(False)
                torch.cuda.empty_cache()
        flops = 2.0 * n**3
        best[dtype] = flops / min(times)
        median[dtype] = flops / statistics.median(times)
    fast: dict[str, float] = {}
    if "fp8" in best:  # Transformer Engine's forward GEMMs: fast accumulation (module docstring)
        try:
            op = _matmul_op("fp8", n, device, fast_accum=True)
            op()
            fast["fp8"] = 2.0 * n**3 / min(_time_op(op, device, quick))
        except (Unsupported, RuntimeError, NotImplementedError, TypeError) as exc:
            skipped["fp8_fast_accum"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        finally:
            torch.cuda.empty_cache()
    return {"matmul_flops_per_s": best, "matmul_flops_per_s_median": median,
            "matmul_size": {d: n for d in best}, "matmul_skipped": skipped, "matmul_fast_accum_flops_per_s": fast}


def _linear_train_op(m: int, k: int, n: int, tdtype: torch.dtype, device: str) -> Callable[[], object]:
    """The three GEMMs of one linear layer's training step: Y = X·Wᵀ, dX = dY·W, dW = dYᵀ·X (X m × k, W n × k)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen).to(tdtype)
    w = torch.randn(n, k, device=device, generator=gen).to(tdtype)
    dy = torch.randn(m, n, device=device, generator=gen).to(tdtype)
    y, dx, dw = (torch.empty(m, n, device=device, dtype=tdtype), torch.empty(m, k, device=device, dtype=tdtype),
                 torch.empty(n, k, device=device, dtype=tdtype))

    def step() -> object:
        torch.mm(x, w.t(), out=y)
        torch.mm(dy, w, out=dx)
        return torch.mm(dy.t(), x, out=dw)

    return step


def measure_unaligned(device: str, dtypes: list[str], quick: bool) -> dict[str, Any]:
    """Per dtype, the time per FLOP of a head's training GEMMs with an odd vocabulary over a padded one
    (module docstring); a dtype the device cannot run is left out, with why (``unaligned_gemm_skipped``)."""
    m, k, n = UNALIGNED_SHAPE[device][quick]
    tdtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    slowdown: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for dtype in [d for d in UNALIGNED_DTYPES[device] if d in dtypes]:
        if device == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
            skipped[dtype] = "this GPU has no bf16 math"
            continue
        per_flop = []
        try:
            for width in (n, n - 1):
                op = _linear_train_op(m, k, width, tdtypes[dtype], device)
                per_flop.append(min(_time_op(op, device, quick)) / (6.0 * m * k * width))
                del op
        except Exception as exc:  # noqa: BLE001 - no kernel, or no memory, for this dtype here: data, not a failure
            skipped[dtype] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        slowdown[dtype] = per_flop[1] / per_flop[0]
    return {"unaligned_gemm_slowdown": slowdown, "unaligned_gemm_skipped": skipped,
            "unaligned_gemm_shape": {"m": m, "k": k, "n": n - 1, "padded_n": n}}


def measure_copy(device: str, quick: bool) -> dict[str, Any]:
    """Device-to-device copy bandwidth, bytes/s counted as read + write (2 × size per copy)."""
    size = COPY_BYTES[device][quick]
    src = torch.empty(size, dtype=torch.uint8, device=device)
    src.fill_(1)  # touch every page before timing
    dst = torch.empty_like(src)
    dst.fill_(0)
    times = _time_op(lambda: dst.copy_(src), device, quick)
    return {"copy_bytes_per_s": 2.0 * size / min(times),
            "copy_bytes_per_s_median": 2.0 * size / statistics.median(times), "copy_size_bytes": size}


def bus_bandwidth(size_bytes: float, time_s: float, ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth (doc/PERFORMANCE.md): size/time · 2(n−1)/n, bytes/s."""
    return size_bytes / time_s * 2.0 * (ranks - 1) / ranks


def measure_allreduce(device: str, quick: bool) -> dict[str, Any]:
    """All-reduce bus bandwidth over the torchrun processes (one per device); returns rank 0's view."""
    import torch.distributed as dist

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("--allreduce needs torchrun: python -m torch.distributed.run --standalone "
                           "--nproc-per-node N -m optplan.probes.microbench_child --allreduce --out FILE")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA devices: "
                               "use --nproc-per-node <= the GPU count")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if device == "cuda":  # bind the communicator to this rank's GPU (eager NCCL init, no device guessing)
        dist.init_process_group(backend=backend, device_id=dev)
    else:
        dist.init_process_group(backend=backend)
    try:
        ranks = dist.get_world_size()
        if ranks < 2:
            raise RuntimeError("all-reduce bus bandwidth needs at least 2 processes (--nproc-per-node >= 2)")
        by_size: dict[str, float] = {}
        by_size_median: dict[str, float] = {}
        sizes = ALLREDUCE_BYTES[device][quick]
        for size in sizes:
            buf = torch.ones(size // 4, dtype=torch.float32, device=dev)
            for _ in range(WARMUP):
                dist.all_reduce(buf)
            # k from the slowest rank's single all-reduce, so that every rank runs the same number
            t_one = _allreduce_time_s(dist, buf, 1, device, dev)
            k = max(1, math.ceil(REPEAT_TARGET_S[quick] / max(t_one, 1e-7)))
            times = [_allreduce_time_s(dist, buf, k, device, dev) for _ in range(REPEATS[quick])]
            by_size[str(size)] = bus_bandwidth(size, min(times), ranks)
            by_size_median[str(size)] = bus_bandwidth(size, statistics.median(times), ranks)
            del buf
        dist.barrier()
        return {"allreduce_bus_bytes_per_s": by_size[str(sizes[-1])],
                "allreduce_bus_bytes_per_s_by_size": by_size,
                "allreduce_bus_bytes_per_s_median_by_size": by_size_median,
                "allreduce_size_bytes": sizes[-1], "allreduce_ranks": ranks, "allreduce_backend": backend,
                "rank": dist.get_rank()}
    finally:
        dist.destroy_process_group()


def _allreduce_time_s(dist: Any, buf: torch.Tensor, k: int, device: str, dev: torch.device) -> float:
    """Seconds per all-reduce over k back-to-back calls, the slowest rank's figure."""
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(k):
        dist.all_reduce(buf)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / k], dtype=torch.float64, device=dev)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _sdpa_backend(name: str) -> Any:
    """A context manager that forces SDPA backend ``name`` (nullcontext for ``default``); Unsupported when this
    torch has no way to force it."""
    import contextlib

    if name == "default":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:  # torch < 2.3
        raise Unsupported(f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel") from exc
    member = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}[name]
    if not hasattr(SDPBackend, member):
        raise Unsupported(f"torch {torch.__version__} has no SDPBackend.{member}")
    return sdpa_kernel(getattr(SDPBackend, member))


def measure_attention(device: str, quick: bool) -> dict[str, Any]:
    """Causal ``scaled_dot_product_attention`` speed by backend and sequence length (FLOP/s, forward and
    backward): bf16 on CUDA (fp32 on the CPU, whose bf16 is emulated), ``ATTENTION_HEADS`` heads of 128, about
    ``ATTENTION_TOKENS`` tokens per call. FLOPs counted as FlashAttention's benchmarks and
    estimators/attention_kernels.py count them: forward 4·b·h·s²·d halved for the causal mask, backward 2.5x
    the forward's; the backward is timed alone (one forward's graph, its backward repeated). A backend this device
    or torch cannot run is left out with why (``attention_skipped``), never an error."""
    seqs = ATTENTION_SEQS[device][quick]
    heads, d = ATTENTION_HEADS[device], ATTENTION_HEAD_DIM
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rates: dict[str, dict[str, dict[str, float]]] = {}
    skipped: dict[str, str] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for backend in ATTENTION_BACKENDS if device == "cuda" else ("default",):
        by_seq: dict[str, dict[str, float]] = {}
        try:
            for s in seqs:
                b = max(1, ATTENTION_TOKENS[device][quick] // s)
                q, k, v = (torch.randn(b, heads, s, d, device=device, generator=gen).to(dtype).requires_grad_()
                           for _ in range(3))
                grad = torch.randn(b, heads, s, d, device=device, generator=gen).to(dtype)

                def fwd(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> object:
                    with torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                with _sdpa_backend(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

                    def bwd(out: torch.Tensor = out, q: torch.Tensor = q, k: torch.Tensor = k,
                            v: torch.Tensor = v, grad: torch.Tensor = grad) -> object:
                        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

                    t_fwd, t_bwd = min(_time_op(fwd, device, quick)), min(_time_op(bwd, device, quick))
                flops_fwd = 4.0 * b * heads * s * s * d / 2
                by_seq[str(s)] = {"forward": flops_fwd / t_fwd, "backward": 2.5 * flops_fwd / t_bwd}
                del q, k, v, grad, out
        except Unsupported as exc:
            skipped[backend] = str(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - no kernel (or no memory) for this backend here: data, not a failure
            skipped[backend] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rates[backend] = by_seq
    return {"attention_flops_per_s": rates, "attention_skipped": skipped,
            "attention_shape": {"heads": heads, "head_dim": d, "tokens": ATTENTION_TOKENS[device][quick],
                                "dtype": str(dtype).removeprefix("torch.")}}


def write_json_atomic(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` to a temporary file beside ``path``, then rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The measurements as one JSON-able dict (None on ranks other than 0 under --allreduce)."""
    device = _device(args.device)
    doc: dict[str, Any] = {
        "device": device, "device_name": _device_name(device), "torch_version": str(torch.__version__),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpu_threads": torch.get_num_threads(), "quick": bool(args.quick),
        "timing": f"best of {REPEATS[args.quick]} repeats of ~{REPEAT_TARGET_S[args.quick]} s (medians beside)",
        "matmul_flops_per_s": {}, "copy_bytes_per_s": None, "allreduce_bus_bytes_per_s": None,
        "allreduce_ranks": 0,
    }
    if args.allreduce:
        result = measure_allreduce(device, args.quick)
        if result.pop("rank") != 0:
            return None
        doc.update(result)
    else:
        dtypes = args.dtypes or list(DTYPES if device == "cuda" else CPU_DTYPES)
        doc.update(measure_matmul(device, dtypes, args.quick))
        doc.update(measure_unaligned(device, dtypes, args.quick))
        doc.update(measure_copy(device, args.quick))
        doc.update(measure_attention(device, args.quick))
    doc["wall_s"] = time.perf_counter() - _STARTED
    return doc


def main(argv: list[str] | None = None) -> int:
    from optplan.probes._pdeathsig import die_with_launcher

    if not die_with_launcher():  # torchrun's workers run in sessions of their own: die with torchrun
        return 1
    args = _parse_args(argv)
    try:
        doc = run(args)
        if doc is not None:
            write_json_atomic(args.out, doc)
    except Exception as exc:  # noqa: BLE001 - one last line for the parent, traceback above it
        traceback.print_exc()
        message = " ".join(str(exc).split()) or "(no message)"
        print(f"{ERROR_PREFIX} {type(exc).__name__}: {message}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
