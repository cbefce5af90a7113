"""What GPUs are here, and which cluster to plan for.

NVML is reached through one small adapter, :class:`NvmlApi` (the real one is :class:`PynvmlApi`; tests
and the dashboard's tests pass ``optplan.probes.hardware_fake.FakeNvml``). :func:`detect_gpus` never
raises: no NVML library, a driver error or zero devices give ``available=False`` and a one-line reason.
When NVML is not usable it falls back to ``torch.cuda`` (imported lazily, and only where a GPU driver is
visible, so a CPU-only laptop does not pay for importing torch). :func:`cluster_from` turns a report
and the ``--gpu/--gpus/--gpus-per-node`` options into the :class:`Cluster` to plan for, plus notes
that tell the user what was assumed.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import (
    Cluster,
    GPUSpec,
    catalogue_variants,
    find_gpu,
    gpu_catalogue,
    match_device_name,
)

DEFAULT_GPU = "H100-SXM"
DEFAULT_GPUS = 8
DEFAULT_MAX_GPUS_PER_NODE = 8
NO_GPU = "no GPU detected"
# A detected GPU whose memory differs from its catalogue entry's by more than this fraction (a 16 GB
# V100 matched to the 32 GB entry, an H100 NVL matched to H100-SXM) is planned with the detected size.
MEMORY_MISMATCH_FRACTION = 0.10


class MemoryInfo(NamedTuple):
    """Device memory in bytes, as NVML reports it."""

    total: int
    used: int
    free: int


class Utilization(NamedTuple):
    """Percent of the last sample period the GPU was busy, and its memory controller was."""

    gpu_percent: int
    memory_percent: int


@runtime_checkable
class NvmlApi(Protocol):
    """The slice of NVML optplan uses, by device index. Implementations raise ``pynvml.NVMLError``
    (or any exception; :func:`detect_gpus` turns every failure into a clean report)."""

    def init(self) -> None: ...

    def shutdown(self) -> None: ...

    def driver_version(self) -> str: ...

    def device_count(self) -> int: ...

    def device_name(self, index: int) -> str: ...

    def memory_info(self, index: int) -> MemoryInfo: ...

    # For live views (dashboard):
    def utilization(self, index: int) -> Utilization: ...

    def temperature_c(self, index: int) -> int: ...

    def power_usage_watts(self, index: int) -> float: ...

    def power_limit_watts(self, index: int) -> float: ...


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class PynvmlApi:
    """:class:`NvmlApi` over ``pynvml`` (the nvidia-ml-py package). Importing it is cheap; nothing
    touches the driver before :meth:`init`."""

    def __init__(self) -> None:
        import pynvml  # raises ImportError when nvidia-ml-py is missing

        self._nvml: Any = pynvml
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        self._handles.clear()
        self._nvml.nvmlInit()

    def shutdown(self) -> None:
        self._handles.clear()
        self._nvml.nvmlShutdown()

    def driver_version(self) -> str:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def device_name(self, index: int) -> str:
        return _text(self._nvml.nvmlDeviceGetName(self._handle(index)))

    def memory_info(self, index: int) -> MemoryInfo:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle(index))
        return MemoryInfo(total=int(info.total), used=int(info.used), free=int(info.free))

    def utilization(self, index: int) -> Utilization:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle(index))
        return Utilization(gpu_percent=int(rates.gpu), memory_percent=int(rates.memory))

    def temperature_c(self, index: int) -> int:
        return int(self._nvml.nvmlDeviceGetTemperature(self._handle(index), self._nvml.NVML_TEMPERATURE_GPU))

    def power_usage_watts(self, index: int) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle(index)) / 1000.0  # NVML reports mW

    def power_limit_watts(self, index: int) -> float:
        return self._nvml.nvmlDeviceGetEnforcedPowerLimit(self._handle(index)) / 1000.0


class DetectedGPU(BaseModel):
    """One GPU as the driver reports it, and the catalogue entry it maps to (None: not in the catalogue)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    name: str
    memory_total_bytes: int = Field(ge=0)
    catalogue_name: str | None = None


class HardwareReport(BaseModel):
    """What detection found. ``available`` is False (with ``reason`` saying why) when no GPU is usable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    available: bool
    reason: str
    driver_version: str | None = None
    devices: tuple[DetectedGPU, ...] = ()
    backend: Literal["nvml", "torch"] | None = Field(default=None, description="what found the devices")


def _describe(err: BaseException) -> str:
    """An error as one line: NVML errors by their message, anything else with its type."""
    try:
        import pynvml

        if isinstance(err, pynvml.NVMLError):
            return str(err)
    except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
        pass
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _unavailable(detail: str, *, driver_version: str | None = None) -> HardwareReport:
    return HardwareReport(available=False, reason=f"{NO_GPU}: {detail}", driver_version=driver_version)


def summarize_devices(devices: tuple[DetectedGPU, ...] | list[DetectedGPU]) -> str:
    """'8 x NVIDIA H100 80GB HBM3', or '1 x A, 1 x B' for a mixed machine."""
    counts = Counter(d.name for d in devices)
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


def _detected(index: int, name: str, total: int) -> DetectedGPU:
    spec = match_device_name(name, total)
    return DetectedGPU(index=index, name=name, memory_total_bytes=total,
                       catalogue_name=spec.name if spec else None)


def _detect_nvml(nvml: NvmlApi | None) -> HardwareReport:
    if nvml is None:
        try:
            nvml = PynvmlApi()
        except ImportError:
            return _unavailable("nvidia-ml-py (pynvml) is not installed")
    try:
        nvml.init()
    except Exception as err:  # any failure is "no GPU" for planning purposes, never a crash
        return _unavailable(_describe(err))
    driver: str | None = None
    devices: list[DetectedGPU] = []
    try:
        try:
            driver = nvml.driver_version()
        except Exception:  # a missing driver version is not worth losing the devices for
            driver = None
        try:
            count = nvml.device_count()
        except Exception as err:
            return _unavailable(f"NVML could not count devices ({_describe(err)})", driver_version=driver)
        for index in range(count):
            try:
                devices.append(_detected(index, nvml.device_name(index), nvml.memory_info(index).total))
            except Exception as err:
                return _unavailable(f"NVML could not read GPU {index} ({_describe(err)})", driver_version=driver)
    finally:
        try:
            nvml.shutdown()
        except Exception:
            pass
    if not devices:
        return _unavailable("NVML reports 0 devices", driver_version=driver)
    where = f"NVML, driver {driver}" if driver else "NVML"
    return HardwareReport(available=True, reason=f"found {summarize_devices(devices)} via {where}",
                          driver_version=driver, devices=tuple(devices), backend="nvml")


def _gpu_driver_visible() -> bool:
    """Cheap check before importing torch (~2 s): is there any sign of a GPU driver on this machine?"""
    if sys.platform.startswith("linux"):
        return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))
    return sys.platform != "darwin"


def _detect_torch(nvml_reason: str) -> HardwareReport | None:
    """The devices torch.cuda sees, or None when it sees none (or cannot be asked)."""
    if "torch" not in sys.modules and not _gpu_driver_visible():
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        devices = []
        for index in range(int(torch.cuda.device_count())):
            props = torch.cuda.get_device_properties(index)
            devices.append(_detected(index, str(props.name), int(props.total_memory)))
    except Exception:
        return None
    if not devices:
        return None
    why = nvml_reason.removeprefix(f"{NO_GPU}: ")
    return HardwareReport(available=True, reason=f"found {summarize_devices(devices)} via torch.cuda "
                          f"(NVML unavailable: {why})", devices=tuple(devices), backend="torch")


def detect_gpus(nvml: NvmlApi | None = None, *, torch_fallback: bool | None = None) -> HardwareReport:
    """Detect GPUs through NVML (``nvml``: an :class:`NvmlApi`; default the real pynvml). Never raises.

    ``torch_fallback``: ask ``torch.cuda`` when NVML finds nothing. Default: only when ``nvml`` is not
    given (an explicit adapter, e.g. a fake in tests, is taken as the whole truth).
    """
    try:
        report = _detect_nvml(nvml)
        if report.available:
            return report
        use_torch = (nvml is None) if torch_fallback is None else torch_fallback
        if use_torch:
            fallback = _detect_torch(report.reason)
            if fallback is not None:
                return fallback
        return report
    except Exception as err:  # pragma: no cover - belt and braces: detection must never crash a command
        return _unavailable(_describe(err))


def _check_count(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise OptplanError(f"{flag} must be at least 1 (got {value}): pass a positive number, e.g. {flag} 8")


def _planned_spec(devices: tuple[DetectedGPU, ...]) -> tuple[GPUSpec, list[str]]:
    """The catalogue entry to plan the detected devices as (the smallest-memory kind when mixed), with
    its memory replaced by the detected size when the two disagree by more than 10%."""
    catalogue = gpu_catalogue()
    notes: list[str] = []
    kinds = sorted({d.catalogue_name for d in devices if d.catalogue_name},
                   key=lambda name: catalogue[name].memory_bytes)
    spec = catalogue[kinds[0]]
    unknown = [d for d in devices if d.catalogue_name is None]
    if len(kinds) > 1 or unknown:
        notes.append(f"mixed GPUs detected ({summarize_devices(devices)}): planning as if all were "
                     f"{spec.name}; set CUDA_VISIBLE_DEVICES or pass --gpu to choose")
    mine = [d for d in devices if d.catalogue_name == spec.name]
    detected_bytes = min(d.memory_total_bytes for d in mine)
    if abs(detected_bytes - spec.memory_bytes) > MEMORY_MISMATCH_FRACTION * spec.memory_bytes:
        notes.append(f"{mine[0].name} reports {detected_bytes / 2**30:.1f} GiB, the catalogue's {spec.name} "
                     f"{spec.memory_bytes / 2**30:.0f} GiB: planning with the detected size")
        spec = spec.model_copy(update={"memory_bytes": detected_bytes})
    return spec, notes


def _variants_note(given: str, chosen: str) -> str:
    """When ``--gpu`` named a family with several catalogue variants (``A100``: 40 and 80 GB), which one was taken
    and the others (``" A100: the A100-80GB; also A100-40GB"``); else ""."""
    others = catalogue_variants(given, chosen)
    return f" {given}: the {chosen}; also {', '.join(others)}" if others else ""


def cluster_from(report: HardwareReport | None, *, gpu: str | None = None, gpus: int | None = None,
                 gpus_per_node: int | None = None) -> tuple[Cluster, list[str]]:
    """The cluster to plan for, and notes for the user saying what was assumed.

    Precedence: an explicit ``gpu`` (``--gpu``) wins; else the detected GPUs when they map to the
    catalogue (``detected=True``); else 8 x H100-SXM with a note. ``gpus`` defaults to the number of
    detected devices, else 8; ``gpus_per_node`` to min(gpus, 8), or for detected GPUs min(gpus,
    devices in this machine). ``report`` may be None (detection not run). Raises OptplanError for a
    count below 1 and (through find_gpu) for an unknown ``gpu``.
    """
    _check_count("--gpus", gpus)
    _check_count("--gpus-per-node", gpus_per_node)
    devices = report.devices if report is not None and report.available else ()
    notes: list[str] = []

    if gpu is not None:
        spec = find_gpu(gpu)
        n = gpus or len(devices) or DEFAULT_GPUS
        per_node = gpus_per_node or min(n, DEFAULT_MAX_GPUS_PER_NODE)
        notes.append(f"planning for {n} x {spec.name} (--gpu{_variants_note(gpu, spec.name)})")
        detected = False
    elif any(d.catalogue_name for d in devices):
        spec, notes = _planned_spec(devices)
        n = gpus or len(devices)
        per_node = gpus_per_node or min(n, len(devices))
        how = f"detected {summarize_devices(devices)}" + (f"; --gpus {gpus}" if gpus else "")
        notes.insert(0, f"planning for {n} x {spec.name} ({how})")
        detected = True
    else:
        spec = find_gpu(DEFAULT_GPU)
        n = gpus or len(devices) or DEFAULT_GPUS
        per_node = gpus_per_node or min(n, DEFAULT_MAX_GPUS_PER_NODE)
        if devices:
            why = f"detected {summarize_devices(devices)}, which is not in the GPU catalogue"
        elif report is None:
            why = f"{NO_GPU} (detection was not run)"
        else:
            why = f"{NO_GPU} ({report.reason.removeprefix(f'{NO_GPU}: ')})"
        notes.append(f"{why}: planning for {n} x {spec.name}; pass --gpu to choose")
        detected = False

    if n > per_node and n % per_node:
        notes.append(f"{n} GPUs at {per_node} per node leaves the last node with {n % per_node}: "
                     "launchers expect the same number on every node")
    return Cluster(gpu=spec, gpus=n, gpus_per_node=per_node, detected=detected), notes


class GpuSample(BaseModel):
    """One GPU's live readings (a live view such as the dashboard's); None where NVML cannot say."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    name: str
    memory_total_bytes: int = Field(ge=0)
    memory_used_bytes: int = Field(ge=0)
    utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    temperature_c: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None


class LiveReport(BaseModel):
    """A sample of every GPU, or ``available=False`` with the reason (no NVML, no devices)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    available: bool
    reason: str
    driver_version: str | None = None
    samples: tuple[GpuSample, ...] = ()


def _reading(call: Any, index: int) -> Any:
    try:
        return call(index)
    except Exception:  # a reading a GPU does not support (power on some boards) is left out, not fatal
        return None


def sample_gpus(nvml: NvmlApi | None = None) -> LiveReport:
    """Read utilisation, memory, temperature and power of every GPU through NVML. Never raises."""
    if nvml is None:
        try:
            nvml = PynvmlApi()
        except ImportError:
            return LiveReport(available=False, reason=f"{NO_GPU}: nvidia-ml-py (pynvml) is not installed")
    try:
        nvml.init()
    except Exception as err:
        return LiveReport(available=False, reason=f"{NO_GPU}: {_describe(err)}")
    try:
        driver = _reading(lambda _i: nvml.driver_version(), 0)
        try:
            count = nvml.device_count()
        except Exception as err:
            return LiveReport(available=False, reason=f"{NO_GPU}: NVML could not count devices ({_describe(err)})",
                              driver_version=driver)
        samples = []
        for index in range(count):
            try:
                name = nvml.device_name(index)
                mem = nvml.memory_info(index)
            except Exception as err:
                return LiveReport(available=False, driver_version=driver,
                                  reason=f"{NO_GPU}: NVML could not read GPU {index} ({_describe(err)})")
            util = _reading(nvml.utilization, index)
            samples.append(GpuSample(
                index=index, name=name, memory_total_bytes=mem.total, memory_used_bytes=mem.used,
                utilization_percent=None if util is None else util.gpu_percent,
                memory_utilization_percent=None if util is None else util.memory_percent,
                temperature_c=_reading(nvml.temperature_c, index),
                power_watts=_reading(nvml.power_usage_watts, index),
                power_limit_watts=_reading(nvml.power_limit_watts, index)))
    finally:
        try:
            nvml.shutdown()
        except Exception:
            pass
    if not samples:
        return LiveReport(available=False, reason=f"{NO_GPU}: NVML reports 0 devices", driver_version=driver)
    names = ", ".join(f"{n} x {name}" for name, n in Counter(s.name for s in samples).items())
    return LiveReport(available=True, reason=f"{names} via NVML", driver_version=driver, samples=tuple(samples))
