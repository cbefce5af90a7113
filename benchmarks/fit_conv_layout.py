"""Hopper's channels-first convolution passes (estimators/conv_layout.py, estimators/data/conv_layout.yaml) fitted on
the GPU runs of convolution nets that counted channels-first convolution bytes (``benchmarks/results/*``: the
campaign's torchvision and timm ResNet-50 in NCHW; the channels-last twins count none and check the rest of the
model).

Why: the fifth H200 visit's traces put timm's ResNet-50 under bf16 autocast at micro-batch 128 at 55.0 ms busy in
channels-first against 28.8 ms in channels-last, where counted_traffic.py's layout term (0.5 passes, fitted on an RTX
3090) priced 2.4 ms of difference: cuDNN's transposes around every convolution and PyTorch's channels-first batch-norm
kernels. TF32 convolutions (fp32 recipes) pay their own figure: the fp32 twins measured 35.4 against 27.5 ms.

The fit: for each convolution math (16-bit: the bf16 and autocast recipes; TF32: fp32 on a GPU with TF32), the passes
minimising the median |log(predicted / measured)| step time over that math's channels-first runs, on a 0.25 grid in
[0, 12], with the host constants in use (estimators/eager_host.py: fit them after this, then this again). Prints
every run before (counted_traffic.py's 0.5) and after; the channels-last runs are printed as a check (unchanged).
``--write`` stores the passes in estimators/data/conv_layout.yaml with its source line.

    python benchmarks/fit_conv_layout.py [--write]

Last line: ``conv layout passes 16-bit P over N runs, TF32 Q over M runs: step time median |error| A% -> B%``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from unittest import mock

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fidelity_gpu_results import campaign_rows  # noqa: E402

from optplan.estimators import conv_layout, counted_traffic  # noqa: E402
from optplan.estimators.counted_traffic import NCHW_TRANSPOSE_PASSES, counted_step, tf32_convolutions  # noqa: E402
from optplan.estimators.efficiency import efficiency_for  # noqa: E402
from optplan.estimators.precision import get_recipe  # noqa: E402
from optplan.estimators.timing import step_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "estimators" / "data" / "conv_layout.yaml"
GRID = [0.25 * i for i in range(49)]  # 0 .. 12
MEASURED_ON = "H200"
CHANNELS_FIRST_SHARE = 0.1
"""A run is a channels-first convolution net where its channels-first convolution bytes are at least this share of
its step's counted bytes (a ViT's patch embedding alone is not)."""


def math_of(row: object) -> str | None:
    """``16bit`` or ``tf32`` for a run whose convolutions pay the channels-first term, else None."""
    r = row
    if r.strategy.compile or r.cluster.gpu.name != MEASURED_ON:
        return None
    if get_recipe(r.strategy.precision).activation_bytes == 2:
        return "16bit"
    return "tf32" if tf32_convolutions(r.strategy, r.cluster.gpu) else None


def layout_rows(rows: list | None = None) -> tuple[list, list]:
    """(channels-first runs, the others) among ``rows`` (default: every GPU run): eager steps with convolutions on the
    measured GPU, split by their channels-first convolution bytes' share (``CHANNELS_FIRST_SHARE``)."""
    first, last = [], []
    for r in campaign_rows() if rows is None else rows:
        step = counted_step(r.profile, r.strategy)
        if step is None or step.conv_flops_per_sample <= 0 or math_of(r) is None:
            continue
        (first if step.nchw_conv_bytes_per_sample >= CHANNELS_FIRST_SHARE * step.memory_bytes_per_sample
         else last).append(r)
    return first, last


def _log_error(row: object, passes_16bit: float | None, passes_tf32: float | None) -> float:
    """log(predicted / measured) with the given passes (None: counted_traffic.py's 3090 fit for that math)."""
    r = row

    def passes(gpu_name: str, *, tf32: bool, default: float) -> float:
        value = passes_tf32 if tf32 else passes_16bit
        return default if value is None else value

    with mock.patch.object(counted_traffic, "nchw_passes", passes):
        pred = step_time(r.profile, r.strategy, r.cluster, efficiency=efficiency_for(r.cluster.gpu),
                         adam_impl=r.adam_impl).step_s
    return math.log(pred / r.measured_s)


def _pct(errors: list[float]) -> float:
    return 100.0 * statistics.median(abs(math.expm1(e)) for e in errors) if errors else float("nan")


def fit(rows: list) -> dict[str, float]:
    """The fitted passes by convolution math (``16bit``, ``tf32``) over the channels-first ``rows``."""
    out: dict[str, float] = {}
    for kind in ("16bit", "tf32"):
        group = [r for r in rows if math_of(r) == kind]
        if not group:
            continue

        def score(p: float, group: list = group, kind: str = kind) -> tuple[float, float]:
            args = (p, None) if kind == "16bit" else (None, p)
            return statistics.median(abs(_log_error(r, *args)) for r in group), p

        out[kind] = min(GRID, key=score)
    return out


def write(found: dict[str, float], counts: dict[str, int], before: float, after: float) -> None:
    raw = yaml.safe_load(TABLE.read_text(encoding="utf-8")) or {}
    entry = raw.setdefault("measured", {}).setdefault(MEASURED_ON, {})
    entry.pop("source", None)
    entry["passes_16bit"] = found.get("16bit", NCHW_TRANSPOSE_PASSES)
    entry["passes_tf32"] = found.get("tf32", NCHW_TRANSPOSE_PASSES)
    entry.setdefault("applies_to", [MEASURED_ON, "H100-SXM", "H100-PCIe"])
    entry["source"] = (f"fitted by benchmarks/fit_conv_layout.py on the {MEASURED_ON} runs of channels-first "
                       f"convolution nets under benchmarks/results (torchvision's and timm's ResNet-50: "
                       f"{counts.get('16bit', 0)} 16-bit, {counts.get('tf32', 0)} TF32): step time median |error| "
                       f"{before:.1f}% -> {after:.1f}%; one architecture measured (ResNet-50), the H100s take the "
                       f"H200's (the same GH100 die, cuDNN and PyTorch kernels)")
    header = "".join(line + "\n" for line in TABLE.read_text(encoding="utf-8").splitlines() if line.startswith("#"))
    tmp = TABLE.with_suffix(".yaml.tmp")
    tmp.write_text(header + yaml.safe_dump(raw, sort_keys=False, width=120, allow_unicode=True), encoding="utf-8")
    tmp.replace(TABLE)
    conv_layout.measured_layout.cache_clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", action="store_true", help="store the fitted passes in conv_layout.yaml")
    args = parser.parse_args(argv)
    first, last = layout_rows()
    if not first:
        print(f"error: no channels-first convolution runs on the {MEASURED_ON} under benchmarks/results: run "
              "benchmarks/gpu_campaign.py --sections fidelity --models resnet on a GPU", file=sys.stderr)
        return 2
    found = fit(first)
    p16, p32 = found.get("16bit"), found.get("tf32")
    before = [_log_error(r, None, None) for r in first]
    after = [_log_error(r, p16, p32) for r in first]
    print(f"{'run':56s} {'math':>6s} {'meas ms':>8s} {'3090 fit':>9s} {'fitted':>8s}")
    for r, b, a in zip(first, before, after, strict=True):
        print(f"{r.label[:56]:56s} {math_of(r):>6s} {r.measured_s * 1e3:8.1f} {100 * math.expm1(b):+8.1f}% "
              f"{100 * math.expm1(a):+7.1f}%")
    for r in last:
        print(f"{r.label[:56]:56s} {math_of(r):>6s} {r.measured_s * 1e3:8.1f}  "
              f"{100 * math.expm1(_log_error(r, p16, p32)):+.1f}% (little or no channels-first convolution: a check)")
    counts = {k: sum(1 for r in first if math_of(r) == k) for k in ("16bit", "tf32")}
    in_use = conv_layout.measured_layout().get(MEASURED_ON)
    if in_use is not None:
        print(f"in use (estimators/data/conv_layout.yaml): 16-bit {in_use.passes_16bit}, TF32 {in_use.passes_tf32}")
    if args.write:
        write(found, counts, _pct(before), _pct(after))
        print(f"wrote {TABLE.relative_to(ROOT)}")
    print(f"conv layout passes 16-bit {p16} over {counts['16bit']} runs, TF32 {p32} over {counts['tf32']} runs: step "
          f"time median |error| {_pct(before):.1f}% -> {_pct(after):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
