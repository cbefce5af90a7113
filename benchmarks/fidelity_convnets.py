"""Convolution-net step-time fidelity: optplan's torch engine against published, measured PyTorch runs of image
models (timm's own train benchmark on an RTX 3090, NVIDIA DeepLearningExamples' ResNet-50 on V100 and A100).

Data: ``benchmarks/data/convnets_published.json``: 46 measured runs of 19 timm architectures (ResNet 18-152,
ResNeXt, Wide ResNet, EfficientNet, MobileNet v2/v3, DenseNet, ConvNeXt, VGG, RegNetY, Inception v3, two ViTs)
in eager PyTorch, AMP fp16 and fp32/TF32, NCHW and channels-last (NHWC), 1 and 8 GPUs, each with its source.
These models have no transformer shape: optplan prices them with its FLOPs-only model (estimators/compute.py
``compute_time``, estimators/timing.py ``_flops_only_step``), which was fitted on none of these runs.

Prediction, through optplan's own pipeline, no per-row constant:

* the profile: a model file per (architecture, image side, layout) that builds ``timm.create_model(name)`` (1000
  classes) and its input, in ``torch.channels_last`` for the NHWC runs (the layout is the model file's, as a user
  would write it), profiled like any model file (``probes.loader.profile_model_file``; the profile cache keeps
  them between runs);
* the plan: ``Strategy(engine="torch", precision=..., optimizer="sgd", mbs=batch, dp=GPUs)``: DDP over the GPUs;
* the cluster: the row's catalogue GPU, 8 per node (DGX-1 V100, DGX A100; one RTX 3090);
* ``estimators.estimate.estimate`` -> the step time, against the measured one.

Run: ``python benchmarks/fidelity_convnets.py [--write] [--models a,b]`` (``--write`` also writes
benchmarks/results/fidelity_convnets.txt). Needs timm (and, on a CPU-only torch, benchmarks/torchvision_ops/
install.py). Last line: ``convnets: MAPE X% over N runs; median predicted/measured R``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optplan.estimators.estimate import Estimate, estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "data" / "convnets_published.json"
RESULT = ROOT / "results" / "fidelity_convnets.txt"

MODEL_FILE = '''"""timm {name} at {side}x{side}, 1000 classes, {layout} (benchmarks/fidelity_convnets.py)."""

import timm
import torch
import torch.nn.functional as F

OPTPLAN = {{"name": "{name}", "optimizer": "sgd"}}
CHANNELS_LAST = {nhwc}


class Net(torch.nn.Module):
    """The timm model; ``labels`` accepted (``model(*example_batch)``) and left to ``loss_fn``."""

    def __init__(self):
        super().__init__()
        self.net = timm.create_model("{name}", pretrained=False, num_classes=1000)

    def forward(self, images, labels=None):
        return self.net(images)


def build_model():
    model = Net()
    return model.to(memory_format=torch.channels_last) if CHANNELS_LAST else model


def example_batch(batch_size, seq_len):
    images = torch.randn(batch_size, 3, {side}, {side})
    if CHANNELS_LAST:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 1000, (batch_size,))


def loss_fn(logits, batch):
    return F.cross_entropy(logits, batch[1])
'''


@dataclass(frozen=True)
class Result:
    row: dict[str, Any]
    est: Estimate

    @property
    def measured_s(self) -> float:
        return float(self.row["step_s"])

    @property
    def ratio(self) -> float:
        """Predicted ÷ measured step time."""
        return self.est.time.step_s / self.measured_s

    @property
    def in_band(self) -> bool:
        t = self.est.time
        return t.step_s_low <= self.measured_s <= t.step_s_high


def load() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sources, rows) of the data file."""
    doc = json.loads(DATA.read_text(encoding="utf-8"))
    return doc["sources"], doc["rows"]


def model_key(row: dict[str, Any]) -> tuple[str, int, str]:
    return row["model"], int(row["image_size"]), row["memory_format"]


def model_file(folder: Path, key: tuple[str, int, str]) -> Path:
    """The model file of ``key`` under ``folder`` (written once; a stable path, so the profile cache hits)."""
    name, side, layout = key
    path = folder / f"{name}_{side}_{layout}.py"
    text = MODEL_FILE.format(name=name, side=side, layout=layout.upper(), nhwc=layout == "nhwc")
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    return path


def _profile_key(path: Path) -> str:
    """What a profile of ``path`` depends on: the model file, the profiler (optplan's probes and the profile schema),
    torch and timm. Not the time model: editing an estimator constant reuses the profiles."""
    import timm
    import torch

    import optplan.estimators.profile as schema
    import optplan.probes as probes

    digest = hashlib.sha256(path.read_bytes())
    for file in sorted(Path(probes.__file__).parent.rglob("*.py")) + [Path(schema.__file__)]:
        digest.update(file.read_bytes())
    digest.update(f"{torch.__version__} {timm.__version__}".encode())
    return digest.hexdigest()


def profiles(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str], ModelProfile]:
    """Each distinct model's profile (the model files live in the optplan cache folder, beside the benchmark's own
    profile store ``convnet_profiles.json``: keyed by :func:`_profile_key`, so that refitting a time constant does not
    profile the 38 models again)."""
    from optplan.probes.cache_dir import cache_dir
    from optplan.probes.loader import profile_model_file

    folder = cache_dir() / "bench-convnets"
    store_path = folder / "convnet_profiles.json"
    try:
        store = json.loads(store_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        store = {}
    out = {}
    changed = False
    for key in sorted({model_key(r) for r in rows}):
        path = model_file(folder, key)
        pkey = _profile_key(path)
        try:
            out[key] = ModelProfile.model_validate(store[pkey])
        except (KeyError, ValueError):
            out[key] = profile_model_file(path, seq_len=None)
            store[pkey] = out[key].model_dump(mode="json")
            changed = True
    if changed:
        tmp = store_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(store), encoding="utf-8")
        tmp.replace(store_path)
    return out


def plan(row: dict[str, Any]) -> Strategy:
    """The optplan plan of ``row``: torch (DDP over its GPUs), its precision, SGD, its batch per GPU."""
    return Strategy(engine="torch", precision=row["precision"], optimizer="sgd", mbs=int(row["batch_per_gpu"]),
                    dp=int(row["gpus"]))


def cluster_for(row: dict[str, Any]) -> Cluster:
    return Cluster(gpu=find_gpu(row["gpu"]), gpus=int(row["gpus"]), gpus_per_node=8)


def predict(row: dict[str, Any], profile: ModelProfile) -> Result:
    with contextlib.redirect_stderr(io.StringIO()):
        est = estimate(profile, cluster_for(row), plan(row))
    return Result(row=row, est=est)


def domain_rows() -> list[Any]:
    """Every run as a ``published_sets.Row`` (set ``convnets-timm`` or ``convnets-dle``), for the time model's measured
    domain (``fidelity_published.py --write-domain``: the FLOPs-only models' sets on the RTX 3090, V100 and A100).
    All are judged: two constants (counted_traffic.py) were fitted on the 38 timm runs, and with each architecture
    left out the error moves 6.7 % -> 7.1 % (benchmarks/fit_counted_traffic.py)."""
    from published_sets import Row

    _, rows = load()
    profs = profiles(rows)
    return [Row(set="convnets-timm" if r["source"].startswith("timm-") else "convnets-dle", label=r["id"],
                profile=profs[model_key(r)], cluster=cluster_for(r), strategy=plan(r), measured_s=float(r["step_s"]))
            for r in rows]


def mape(ratios: list[float]) -> float:
    return 100.0 * sum(abs(r - 1.0) for r in ratios) / len(ratios) if ratios else float("nan")


def report(results: list[Result], out: io.TextIOBase) -> tuple[float, float]:
    """Print the per-row table and the groups; (MAPE %, median predicted/measured)."""
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p("convolution nets: optplan (estimate, torch engine) against published measured step times")
    p("ratio = predicted ÷ measured step time; parts = optplan's compute / memory-bound / host ms")
    p("")
    p(f"{'run':44s} {'GPU':10s} {'n':>2s} {'prec':8s} {'fmt':4s} {'mbs':>4s} {'meas ms':>8s} {'pred ms':>8s} "
      f"{'ratio':>5s} {'band':4s}  parts")
    for r in results:
        row, t = r.row, r.est.time
        parts = f"{1e3 * t.compute_s:.0f}/{1e3 * t.memory_bound_s:.0f}/{1e3 * t.host_overhead_s:.0f}"
        p(f"{row['id']:44s} {row['gpu']:10s} {row['gpus']:2d} {row['precision']:8s} {row['memory_format']:4s} "
          f"{row['batch_per_gpu']:4d} {1e3 * r.measured_s:8.1f} {1e3 * t.step_s:8.1f} {r.ratio:5.2f} "
          f"{'in' if r.in_band else 'OUT':4s}  {parts}")
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        row = r.row
        groups[f"source {row['source']}"].append(r)
        groups[f"layout {row['memory_format']}"].append(r)
        groups[f"precision {row['precision']}"].append(r)
        groups["vit" if row["model"].startswith("vit") else "convolution nets"].append(r)
    p("")
    p(f"{'group':32s} {'runs':>4s} {'MAPE':>6s} {'median':>6s} {'min':>5s} {'max':>5s} {'in band':>7s}")
    for name in sorted(groups):
        g = groups[name]
        ratios = [x.ratio for x in g]
        p(f"{name:32s} {len(g):4d} {mape(ratios):5.1f}% {statistics.median(ratios):6.2f} {min(ratios):5.2f} "
          f"{max(ratios):5.2f} {sum(x.in_band for x in g):7d}")
    ratios = [r.ratio for r in results]
    p("")
    p(f"measured step inside the estimate's band (time.step_s_low-high): {sum(r.in_band for r in results)} of "
      f"{len(results)}")
    return mape(ratios), statistics.median(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"also write {RESULT.relative_to(ROOT.parent)}")
    parser.add_argument("--models", default=None, help="comma-separated subset of the timm architectures")
    args = parser.parse_args(argv)
    _, rows = load()
    if args.models:
        keep = set(args.models.split(","))
        rows = [r for r in rows if r["model"] in keep]
    profs = profiles(rows)
    results = [predict(r, profs[model_key(r)]) for r in rows]
    buf = io.StringIO()
    err, med = report(results, buf)
    last = f"convnets: MAPE {err:.1f}% over {len(results)} runs; median predicted/measured {med:.2f}"
    print(buf.getvalue() + last)
    if args.write:
        RESULT.write_text(buf.getvalue() + last + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
