"""The packaged GPU catalogue (estimators/data/gpus.yaml): loads, holds datasheet figures, maps names."""

from __future__ import annotations

import re

import pytest
import yaml

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import _catalogue_text, _norm, find_gpu, gpu_catalogue, match_device_name

EXPECTED = {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "L4", "A10G",
            "RTX-4090", "V100"}
FP8_GPUS = {"H100-SXM", "H100-PCIe", "H200", "B200", "L40S", "L4", "RTX-4090"}
GiB = 2**30


def test_catalogue_has_exactly_the_expected_entries() -> None:
    assert set(gpu_catalogue()) == EXPECTED


def test_yaml_numbers_are_numbers_not_strings() -> None:
    # YAML 1.1 reads "989.5e12" (no signed exponent) as a string; pydantic would quietly coerce it.
    for entry in yaml.safe_load(_catalogue_text())["gpus"]:
        for key in ("memory_bytes", "memory_bandwidth_bytes_per_s", "intra_node_bandwidth_bytes_per_s", "tdp_watts"):
            assert isinstance(entry[key], int | float), (entry["name"], key, entry[key])
        for dtype, value in entry["peak_flops"].items():
            assert isinstance(value, int | float), (entry["name"], dtype, value)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_entry_is_complete_and_plausible(name: str) -> None:
    spec = gpu_catalogue()[name]
    assert spec.memory_bytes > 0 and spec.memory_bytes % GiB == 0  # datasheet GB figure x 2**30
    assert 100e9 <= spec.memory_bandwidth_bytes_per_s <= 20e12
    assert max(spec.peak_flops_for("bf16"), spec.peak_flops_for("fp16")) > 0
    assert spec.peak_flops_for("fp32") > 0
    assert spec.peak_flops_for("fp16") >= spec.peak_flops_for("fp32")
    assert spec.peak_flops_for("tf32") <= spec.peak_flops_for("fp16")
    if spec.supports_fp8:
        assert spec.peak_flops_for("fp8") >= spec.peak_flops_for("fp16")
    assert spec.intra_node_bandwidth_bytes_per_s > 0 and spec.intra_node_link
    assert spec.tdp_watts > 0
    assert re.search(r"https://\S+", spec.source), spec.source


def test_dtype_support_matches_the_hardware() -> None:
    catalogue = gpu_catalogue()
    assert {n for n, s in catalogue.items() if s.supports_fp8} == FP8_GPUS
    assert {n for n, s in catalogue.items() if not s.supports_bf16} == {"V100"}
    v100 = catalogue["V100"]
    assert v100.peak_flops_for("tf32") == 0 and v100.peak_flops_for("fp8") == 0
    assert v100.peak_flops_for("fp16") == 125e12 and v100.memory_bytes == 32 * GiB


def test_h100_sxm_datasheet_figures() -> None:
    h100 = find_gpu("H100-SXM")
    assert h100.memory_bytes == 80 * GiB
    assert h100.memory_bandwidth_bytes_per_s == 3.35e12
    # Datasheet "with sparsity" figures halved: TF32 989, BF16/FP16 1,979, FP8 3,958 TFLOPS.
    assert h100.peak_flops == {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12,
                               "fp8": 1979e12}
    assert h100.intra_node_bandwidth_bytes_per_s == 450e9  # NVLink4 900 GB/s bidirectional
    assert h100.intra_node_link == "NVLink4"
    assert h100.tdp_watts == 700


def test_a100_80gb_datasheet_figures() -> None:
    a100 = find_gpu("A100-80GB")
    assert a100.memory_bytes == 80 * GiB
    assert a100.memory_bandwidth_bytes_per_s == 2.039e12
    assert a100.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert not a100.supports_fp8
    assert a100.intra_node_bandwidth_bytes_per_s == 300e9  # NVLink3 600 GB/s bidirectional
    assert a100.tdp_watts == 400


def test_large_hbm_parts_use_the_binary_convention() -> None:
    assert find_gpu("H200").memory_bytes == 141 * GiB
    assert find_gpu("B200").memory_bytes == 180 * GiB
    assert find_gpu("A100-40GB").memory_bytes == 40 * GiB


@pytest.mark.parametrize(("typed", "expected"), [
    ("H100", "H100-SXM"), ("h100-80gb", "H100-SXM"), ("H100 SXM5", "H100-SXM"), ("H100-80GB", "H100-SXM"),
    ("h100 pcie", "H100-PCIe"), ("A100", "A100-80GB"), ("a100-40gb", "A100-40GB"), ("A100_80GB", "A100-80GB"),
    ("V100-32GB", "V100"), ("v100", "V100"), ("4090", "RTX-4090"), ("RTX 4090", "RTX-4090"),
    ("h200", "H200"), ("B200", "B200"), ("l40s", "L40S"), ("L4", "L4"), ("a10g", "A10G"),
])
def test_user_aliases(typed: str, expected: str) -> None:
    assert find_gpu(typed).name == expected


@pytest.mark.parametrize(("driver_name", "expected"), [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("Tesla V100-SXM2-32GB", "V100"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"),
])
def test_driver_names_map_to_entries(driver_name: str, expected: str) -> None:
    spec = match_device_name(driver_name)
    assert spec is not None and spec.name == expected


def test_unknown_driver_name_maps_to_nothing() -> None:
    assert match_device_name("Tesla T4") is None
    assert match_device_name("AMD Instinct MI300X") is None


def test_every_name_and_alias_round_trips() -> None:
    for spec in gpu_catalogue().values():
        for typed in (spec.name, *spec.aliases):
            assert find_gpu(typed).name == spec.name, typed
            matched = match_device_name(typed)
            assert matched is not None and matched.name == spec.name, typed


def test_aliases_are_unique_across_entries() -> None:
    owner: dict[str, str] = {}
    for spec in gpu_catalogue().values():
        for key in {_norm(spec.name), *(_norm(a) for a in spec.aliases)}:
            assert key not in owner, f"{key!r} is claimed by {owner.get(key)} and {spec.name}"
            owner[key] = spec.name


def test_unknown_gpu_error_lists_the_known_gpus() -> None:
    with pytest.raises(OptplanError) as info:
        find_gpu("TPU v5p")
    message = str(info.value)
    assert "TPU v5p" in message and "--gpu" in message and "\n" not in message
    for name in EXPECTED:
        assert name in message
