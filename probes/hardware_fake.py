"""A fake NVML for tests (probe tests, dashboard tests): implements optplan.probes.hardware.NvmlApi.

    FakeNvml([("NVIDIA H100 80GB HBM3", 80 * 2**30)] * 8)          # 8 healthy H100s
    FakeNvml.library_missing()                                      # like a machine with no driver
    FakeNvml(devices, errors={"memory_info:3": nvml_error("NVML_ERROR_GPU_IS_LOST")})

It behaves like pynvml where tests can tell: calls before ``init`` raise NVMLError_Uninitialized, an
index out of range raises NVMLError_InvalidArgument, errors are real ``pynvml.NVMLError`` subclasses.
``errors`` maps a method name (``"init"``, ``"device_count"``, ``"device_name"``, ...) or
``"method:index"`` to the exception that call raises. Live readings (utilization, temperature, power)
are plain attributes of each :class:`FakeDevice`, so a test can change them between frames.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pynvml

from optplan.probes.hardware import MemoryInfo, Utilization


def nvml_error(code: str | int) -> pynvml.NVMLError:
    """A real pynvml error, e.g. ``nvml_error("NVML_ERROR_LIBRARY_NOT_FOUND")`` (its str() is NVML's text)."""
    value = getattr(pynvml, code) if isinstance(code, str) else code
    return pynvml.NVMLError(value)


@dataclass
class FakeDevice:
    """One fake GPU; mutable so live views can be driven frame by frame."""

    name: str
    memory_total: int
    memory_used: int = 0
    utilization_gpu: int = 0
    utilization_memory: int = 0
    temperature_c: int = 35
    power_watts: float = 70.0
    power_limit_watts: float = 700.0


class FakeNvml:
    """An in-memory NVML. ``devices``: (name, total memory bytes) pairs or :class:`FakeDevice` objects."""

    def __init__(self, devices: Iterable[tuple[str, int] | FakeDevice] = (), *,
                 driver_version: str = "550.54.15",
                 errors: Mapping[str, BaseException] | None = None) -> None:
        self.devices: list[FakeDevice] = [d if isinstance(d, FakeDevice) else FakeDevice(name=d[0], memory_total=d[1])
                                          for d in devices]
        self.driver = driver_version
        self.errors: dict[str, BaseException] = dict(errors or {})
        self.initialized = False
        self.init_calls = 0
        self.shutdown_calls = 0

    @classmethod
    def library_missing(cls) -> FakeNvml:
        """What pynvml does on a machine without the NVIDIA driver: init raises LibraryNotFound."""
        return cls(errors={"init": nvml_error("NVML_ERROR_LIBRARY_NOT_FOUND")})

    def _maybe_fail(self, method: str, index: int | None = None) -> None:
        for key in (method, f"{method}:{index}") if index is not None else (method,):
            if key in self.errors:
                raise self.errors[key]

    def _ready(self, method: str, index: int | None = None) -> FakeDevice | None:
        if not self.initialized:
            raise nvml_error("NVML_ERROR_UNINITIALIZED")
        self._maybe_fail(method, index)
        if index is None:
            return None
        if not 0 <= index < len(self.devices):
            raise nvml_error("NVML_ERROR_INVALID_ARGUMENT")
        return self.devices[index]

    def init(self) -> None:
        self.init_calls += 1
        self._maybe_fail("init")
        self.initialized = True

    def shutdown(self) -> None:
        self.shutdown_calls += 1
        if not self.initialized:
            raise nvml_error("NVML_ERROR_UNINITIALIZED")
        self.initialized = False
        self._maybe_fail("shutdown")

    def driver_version(self) -> str:
        self._ready("driver_version")
        return self.driver

    def device_count(self) -> int:
        self._ready("device_count")
        return len(self.devices)

    def _device(self, method: str, index: int) -> FakeDevice:
        device = self._ready(method, index)
        assert device is not None
        return device

    def device_name(self, index: int) -> str:
        return self._device("device_name", index).name

    def memory_info(self, index: int) -> MemoryInfo:
        d = self._device("memory_info", index)
        return MemoryInfo(total=d.memory_total, used=d.memory_used, free=d.memory_total - d.memory_used)

    def utilization(self, index: int) -> Utilization:
        d = self._device("utilization", index)
        return Utilization(gpu_percent=d.utilization_gpu, memory_percent=d.utilization_memory)

    def temperature_c(self, index: int) -> int:
        return self._device("temperature_c", index).temperature_c

    def power_usage_watts(self, index: int) -> float:
        return self._device("power_usage_watts", index).power_watts

    def power_limit_watts(self, index: int) -> float:
        return self._device("power_limit_watts", index).power_limit_watts
