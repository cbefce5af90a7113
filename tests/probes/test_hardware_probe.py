"""GPU detection through the NVML adapter (real pynvml, FakeNvml, torch fallback) and cluster_from."""

from __future__ import annotations

import sys
import types

import pynvml
import pytest

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import find_gpu
from optplan.probes.hardware import (
    DetectedGPU,
    HardwareReport,
    NvmlApi,
    PynvmlApi,
    cluster_from,
    detect_gpus,
)
from optplan.probes.hardware_fake import FakeDevice, FakeNvml, nvml_error

GiB = 2**30
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_NVML_BYTES = 81559 * 2**20  # what nvidia-smi reports for an H100 80GB


def h100s(n: int = 8) -> FakeNvml:
    return FakeNvml([(H100_NAME, H100_NVML_BYTES)] * n)


def fake_torch(devices: list[tuple[str, int]], *, available: bool = True, explode: bool = False) -> types.ModuleType:
    module = types.ModuleType("torch")

    def props(i: int) -> types.SimpleNamespace:
        if explode:
            raise RuntimeError("CUDA error: no kernel image is available")
        return types.SimpleNamespace(name=devices[i][0], total_memory=devices[i][1])

    module.cuda = types.SimpleNamespace(is_available=lambda: available,  # type: ignore[attr-defined]
                                        device_count=lambda: len(devices), get_device_properties=props)
    return module


def real_nvml_available() -> bool:
    return detect_gpus(torch_fallback=False).available


# --- real pynvml --------------------------------------------------------------------------------------

def test_real_nvml_never_raises() -> None:
    report = detect_gpus()
    assert isinstance(report, HardwareReport)
    assert report.available == bool(report.devices)


def test_real_nvml_without_gpu_gives_a_clean_reason() -> None:
    report = detect_gpus(torch_fallback=False)
    if report.available:
        pytest.skip("this machine has a GPU")
    assert report.reason.startswith("no GPU detected: ")
    assert report.devices == () and report.backend is None
    assert "\n" not in report.reason


def test_real_pynvml_adapter_raises_nvml_errors_not_crashes() -> None:
    if real_nvml_available():
        pytest.skip("this machine has a GPU")
    api = PynvmlApi()
    assert isinstance(api, NvmlApi)
    with pytest.raises(pynvml.NVMLError):
        api.init()


def test_pynvml_adapter_converts_units_and_bytes() -> None:
    api = PynvmlApi()
    stub = types.SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda i: f"handle{i}",
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=100, used=30, free=70),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetTemperature=lambda h, sensor: 61,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetPowerUsage=lambda h: 612_345,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
    )
    api._nvml = stub
    assert api.device_name(0) == "NVIDIA H100 80GB HBM3"
    assert api.driver_version() == "550.54.15" and api.device_count() == 1
    assert tuple(api.memory_info(0)) == (100, 30, 70)
    assert api.utilization(0).gpu_percent == 87 and api.temperature_c(0) == 61
    assert api.power_usage_watts(0) == pytest.approx(612.345) and api.power_limit_watts(0) == 700.0


# --- FakeNvml -----------------------------------------------------------------------------------------

def test_eight_h100s_map_to_h100_sxm() -> None:
    fake = h100s(8)
    report = detect_gpus(fake)
    assert report.available and report.backend == "nvml"
    assert report.driver_version == "550.54.15"
    assert [d.index for d in report.devices] == list(range(8))
    assert all(d.name == H100_NAME and d.catalogue_name == "H100-SXM" for d in report.devices)
    assert all(d.memory_total_bytes == H100_NVML_BYTES for d in report.devices)
    assert "8 x NVIDIA H100 80GB HBM3" in report.reason
    assert fake.init_calls == 1 and fake.shutdown_calls == 1 and not fake.initialized


@pytest.mark.parametrize(("name", "memory", "expected"), [
    ("NVIDIA A100-SXM4-40GB", 40 * GiB, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 80 * GiB, "A100-80GB"),
    ("NVIDIA H100 PCIe", 81559 * 2**20, "H100-PCIe"),
    ("NVIDIA GeForce RTX 4090", 24564 * 2**20, "RTX-4090"),
    ("Tesla V100-SXM2-32GB", 32510 * 2**20, "V100"),
    ("NVIDIA L4", 23034 * 2**20, "L4"),
    ("NVIDIA A10G", 23028 * 2**20, "A10G"),
    ("NVIDIA L40S", 46068 * 2**20, "L40S"),
    ("NVIDIA H200", 143771 * 2**20, "H200"),
    ("NVIDIA B200", 183359 * 2**20, "B200"),
    ("Tesla T4", 15360 * 2**20, "T4"),
    ("Tesla P100-PCIE-16GB", 16280 * 2**20, None),
])
def test_driver_names_are_mapped_through_the_fake(name: str, memory: int, expected: str | None) -> None:
    (device,) = detect_gpus(FakeNvml([(name, memory)])).devices
    assert device.catalogue_name == expected


def test_missing_library_is_a_clean_unavailable_report() -> None:
    fake = FakeNvml.library_missing()
    report = detect_gpus(fake)
    assert not report.available
    assert report.reason == "no GPU detected: NVML Shared Library Not Found"
    assert report.devices == () and report.driver_version is None
    assert fake.init_calls == 1 and fake.shutdown_calls == 0


@pytest.mark.parametrize("error", [
    nvml_error("NVML_ERROR_DRIVER_NOT_LOADED"),
    nvml_error("NVML_ERROR_UNKNOWN"),
    nvml_error("NVML_ERROR_LIB_RM_VERSION_MISMATCH"),
    nvml_error("NVML_ERROR_NO_PERMISSION"),
    nvml_error(999),  # a code this pynvml does not know
    OSError("libnvidia-ml.so.1: cannot open shared object file"),
])
def test_any_init_error_is_clean(error: BaseException) -> None:
    report = detect_gpus(FakeNvml([(H100_NAME, H100_NVML_BYTES)], errors={"init": error}))
    assert not report.available and report.devices == ()
    assert report.reason.startswith("no GPU detected: ") and "\n" not in report.reason


def test_non_nvml_errors_name_their_type() -> None:
    report = detect_gpus(FakeNvml(errors={"init": OSError("boom")}))
    assert report.reason == "no GPU detected: OSError: boom"


@pytest.mark.parametrize(("key", "where"), [
    ("device_name", "GPU 0"),
    ("memory_info:3", "GPU 3"),
    ("device_count", "could not count devices"),
])
def test_device_query_errors_are_clean_and_shut_nvml_down(key: str, where: str) -> None:
    fake = FakeNvml([(H100_NAME, H100_NVML_BYTES)] * 8, errors={key: nvml_error("NVML_ERROR_GPU_IS_LOST")})
    report = detect_gpus(fake)
    assert not report.available and report.devices == ()
    assert report.reason.startswith("no GPU detected: ")
    assert where in report.reason and "GPU is lost" in report.reason
    assert report.driver_version == "550.54.15"
    assert fake.shutdown_calls == 1 and not fake.initialized


def test_zero_devices_is_unavailable() -> None:
    report = detect_gpus(FakeNvml([]))
    assert not report.available
    assert report.reason == "no GPU detected: NVML reports 0 devices"
    assert report.driver_version == "550.54.15"


def test_driver_version_or_shutdown_failures_do_not_lose_the_devices() -> None:
    errors = {"driver_version": nvml_error("NVML_ERROR_UNKNOWN"), "shutdown": nvml_error("NVML_ERROR_UNKNOWN")}
    report = detect_gpus(FakeNvml([(H100_NAME, H100_NVML_BYTES)] * 2, errors=errors))
    assert report.available and len(report.devices) == 2 and report.driver_version is None


def test_report_round_trips_through_json() -> None:
    report = detect_gpus(h100s(2))
    assert HardwareReport.model_validate_json(report.model_dump_json()) == report


def test_fake_behaves_like_pynvml() -> None:
    fake = FakeNvml([FakeDevice("NVIDIA H100 80GB HBM3", 80 * GiB, memory_used=10 * GiB, utilization_gpu=93,
                                temperature_c=70, power_watts=650.0)])
    assert isinstance(fake, NvmlApi)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.device_count()
    fake.init()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        fake.device_name(1)
    assert fake.memory_info(0).free == 70 * GiB
    assert fake.utilization(0).gpu_percent == 93 and fake.temperature_c(0) == 70
    fake.devices[0].power_watts = 300.0  # live views can drive readings frame by frame
    assert fake.power_usage_watts(0) == 300.0 and fake.power_limit_watts(0) == 700.0
    fake.shutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.shutdown()


# --- torch fallback -----------------------------------------------------------------------------------

def test_explicit_adapter_is_the_whole_truth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch([(H100_NAME, H100_NVML_BYTES)]))
    report = detect_gpus(FakeNvml.library_missing())
    assert not report.available


def test_torch_fallback_when_nvml_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake_torch([("NVIDIA A100-SXM4-80GB", 80 * GiB)] * 2))
    report = detect_gpus(FakeNvml.library_missing(), torch_fallback=True)
    assert report.available and report.backend == "torch" and report.driver_version is None
    assert [d.catalogue_name for d in report.devices] == ["A100-80GB", "A100-80GB"]
    assert "NVML unavailable: NVML Shared Library Not Found" in report.reason


def test_default_detection_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    if real_nvml_available():
        pytest.skip("this machine has a GPU: NVML answers first")
    monkeypatch.setitem(sys.modules, "torch", fake_torch([(H100_NAME, H100_NVML_BYTES)]))
    report = detect_gpus()
    assert report.available and report.backend == "torch"


@pytest.mark.parametrize("torch_module", [
    fake_torch([], available=False),
    fake_torch([]),
    fake_torch([(H100_NAME, H100_NVML_BYTES)], explode=True),
])
def test_torch_fallback_that_finds_nothing_keeps_the_nvml_reason(monkeypatch: pytest.MonkeyPatch,
                                                                 torch_module: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, "torch", torch_module)
    report = detect_gpus(FakeNvml.library_missing(), torch_fallback=True)
    assert not report.available
    assert report.reason == "no GPU detected: NVML Shared Library Not Found"


# --- cluster_from -------------------------------------------------------------------------------------

def no_gpu() -> HardwareReport:
    return detect_gpus(FakeNvml.library_missing())


def test_no_gpu_defaults_to_8_h100_with_a_note() -> None:
    cluster, notes = cluster_from(no_gpu(), gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu == find_gpu("H100-SXM")
    assert (cluster.gpus, cluster.gpus_per_node, cluster.detected) == (8, 8, False)
    assert notes == ["no GPU detected (NVML Shared Library Not Found): planning for 8 x H100-SXM; "
                     "pass --gpu to choose"]


def test_detection_not_run_is_said_so() -> None:
    cluster, notes = cluster_from(None, gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu.name == "H100-SXM" and cluster.gpus == 8
    assert "detection was not run" in notes[0]


def test_detected_gpus_are_planned_for() -> None:
    cluster, notes = cluster_from(detect_gpus(h100s(8)), gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu == find_gpu("H100-SXM")  # NVML's 81559 MiB is within 10%: catalogue figures kept
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes, cluster.detected) == (8, 8, 1, True)
    assert notes == ["planning for 8 x H100-SXM (detected 8 x NVIDIA H100 80GB HBM3)"]


def test_explicit_gpu_wins_over_detection() -> None:
    cluster, notes = cluster_from(detect_gpus(h100s(4)), gpu="A100", gpus=None, gpus_per_node=None)
    assert cluster.gpu.name == "A100-80GB" and not cluster.detected
    assert (cluster.gpus, cluster.gpus_per_node) == (4, 4)  # count defaults to the detected GPUs
    # plain "A100" is a family of two: the note says which was taken and what else there is
    assert notes == ["planning for 4 x A100-80GB (--gpu A100: the A100-80GB; also A100-40GB)"]
    assert cluster_from(None, gpu="A100-80GB")[1] == ["planning for 8 x A100-80GB (--gpu)"]


def test_explicit_gpu_without_detection() -> None:
    cluster, notes = cluster_from(None, gpu="h100-80gb", gpus=512, gpus_per_node=8)
    assert cluster.gpu.name == "H100-SXM"
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes, cluster.detected) == (512, 8, 64, False)
    assert notes == ["planning for 512 x H100-SXM (--gpu)"]


@pytest.mark.parametrize(("gpus", "per_node"), [(1, 1), (4, 4), (8, 8), (16, 8), (1024, 8)])
def test_gpus_per_node_defaults_to_min_of_gpus_and_8(gpus: int, per_node: int) -> None:
    cluster, _ = cluster_from(no_gpu(), gpu="H100", gpus=gpus, gpus_per_node=None)
    assert cluster.gpus_per_node == per_node


def test_more_gpus_than_detected_scale_out_nodes_like_this_one() -> None:
    cluster, notes = cluster_from(detect_gpus(h100s(4)), gpu=None, gpus=16, gpus_per_node=None)
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes, cluster.detected) == (16, 4, 4, True)
    assert notes[0] == "planning for 16 x H100-SXM (detected 4 x NVIDIA H100 80GB HBM3; --gpus 16)"


def test_unknown_detected_gpu_falls_back_with_a_note() -> None:
    report = detect_gpus(FakeNvml([("Tesla P100-PCIE-16GB", 16280 * 2**20)] * 2))
    cluster, notes = cluster_from(report, gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu.name == "H100-SXM" and cluster.gpus == 2 and not cluster.detected
    assert notes == ["detected 2 x Tesla P100-PCIE-16GB, which is not in the GPU catalogue: planning for 2 x "
                     "H100-SXM; pass --gpu to choose"]


def test_detected_memory_replaces_the_catalogue_size_when_far_off() -> None:
    report = detect_gpus(FakeNvml([("Tesla V100-SXM2-16GB", 16160 * 2**20)] * 8))
    cluster, notes = cluster_from(report, gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu.name == "V100" and cluster.gpu.memory_bytes == 16160 * 2**20
    assert find_gpu("V100").memory_bytes == 32 * GiB  # the catalogue itself is untouched
    assert any("planning with the detected size" in n for n in notes)


def test_mixed_gpus_plan_as_the_smallest() -> None:
    report = detect_gpus(FakeNvml([("NVIDIA A100-SXM4-80GB", 80 * GiB), ("NVIDIA A100-SXM4-40GB", 40 * GiB)]))
    cluster, notes = cluster_from(report, gpu=None, gpus=None, gpus_per_node=None)
    assert cluster.gpu.name == "A100-40GB" and cluster.gpus == 2 and cluster.detected
    assert any(n.startswith("mixed GPUs detected") for n in notes)


def test_uneven_nodes_are_noted() -> None:
    _, notes = cluster_from(None, gpu="H100", gpus=12, gpus_per_node=8)
    assert any("last node with 4" in n for n in notes)


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"gpus": 0}, "--gpus"), ({"gpus": -8}, "--gpus"),
    ({"gpus_per_node": 0}, "--gpus-per-node"), ({"gpus": 8, "gpus_per_node": -1}, "--gpus-per-node"),
])
def test_bad_counts_raise_one_line_errors(kwargs: dict[str, int], flag: str) -> None:
    with pytest.raises(OptplanError) as info:
        cluster_from(no_gpu(), gpu="H100", **kwargs)
    message = str(info.value)
    assert message.startswith(f"{flag} must be at least 1") and "\n" not in message


def test_bad_counts_raise_even_with_detected_gpus() -> None:
    with pytest.raises(OptplanError, match="--gpus must be at least 1"):
        cluster_from(detect_gpus(h100s()), gpu=None, gpus=0, gpus_per_node=None)


def test_unknown_gpu_raises_listing_known_gpus() -> None:
    with pytest.raises(OptplanError, match="unknown GPU 'MI300X'.*H100-SXM"):
        cluster_from(None, gpu="MI300X", gpus=None, gpus_per_node=None)


def test_detected_gpu_model_is_frozen() -> None:
    gpu = DetectedGPU(index=0, name=H100_NAME, memory_total_bytes=1, catalogue_name="H100-SXM")
    with pytest.raises(ValueError):
        gpu.index = 1  # type: ignore[misc]
