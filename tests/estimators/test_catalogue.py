"""The packaged GPU catalogue (estimators/data/gpus.yaml): loads, holds datasheet figures, maps names."""

from __future__ import annotations

import re

import pytest
import yaml

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import (
    Cluster,
    _catalogue_text,
    _norm,
    close_gpu_names,
    find_gpu,
    gpu_catalogue,
    match_device_name,
    unknown_gpu_message,
)

EXPECTED = {"A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "GB200", "B300", "GB300", "L40S", "L4",
            "A10G",
            "RTX-3090", "RTX-4090", "RTX-5090", "RTX-A6000", "T4", "V100"}
FP8_GPUS = {"H100-SXM", "H100-PCIe", "H200", "B200", "GB200", "B300", "GB300", "L40S", "L4", "RTX-4090", "RTX-5090"}
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
    assert {n for n, s in catalogue.items() if not s.supports_bf16} == {"V100", "T4"}
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
    assert find_gpu("GB200").memory_bytes == 186 * GiB
    # Blackwell Ultra: 288 GB of 12-high HBM3e, of which the platforms list 2.1 TB per 8-GPU HGX B300 board and 20 TB
    # per 72-GPU GB300 rack (the same 15/16 and 31/32 usable shares as the B200's 180 and GB200's 186 of 192)
    assert find_gpu("B300").memory_bytes == 270 * GiB
    assert find_gpu("GB300").memory_bytes == 279 * GiB
    assert find_gpu("A100-40GB").memory_bytes == 40 * GiB


@pytest.mark.parametrize(("typed", "expected"), [
    ("H100", "H100-SXM"), ("h100-80gb", "H100-SXM"), ("H100 SXM5", "H100-SXM"), ("H100-80GB", "H100-SXM"),
    ("h100 pcie", "H100-PCIe"), ("A100", "A100-80GB"), ("a100-40gb", "A100-40GB"), ("A100_80GB", "A100-80GB"),
    ("V100-32GB", "V100"), ("v100", "V100"), ("4090", "RTX-4090"), ("RTX 4090", "RTX-4090"),
    ("h200", "H200"), ("B200", "B200"), ("gb200", "GB200"), ("GB200 NVL72", "GB200"), ("b300", "B300"),
    ("HGX B300", "B300"), ("gb300", "GB300"), ("GB300 NVL72", "GB300"), ("l40s", "L40S"), ("L4", "L4"), ("a10g", "A10G"),
    ("3090", "RTX-3090"), ("rtx 5090", "RTX-5090"), ("A6000", "RTX-A6000"), ("t4", "T4"),
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
    ("NVIDIA GB200", "GB200"),  # contains "B200": the longer alias wins
    ("NVIDIA B300 SXM6 AC", "B300"),
    ("NVIDIA GB300", "GB300"),  # contains "B300": the longer alias wins
    ("NVIDIA GeForce RTX 3090", "RTX-3090"),
    ("NVIDIA GeForce RTX 5090", "RTX-5090"),
    ("NVIDIA RTX A6000", "RTX-A6000"),
    ("Tesla T4", "T4"),
])
def test_driver_names_map_to_entries(driver_name: str, expected: str) -> None:
    spec = match_device_name(driver_name)
    assert spec is not None and spec.name == expected


def test_unknown_driver_name_maps_to_nothing() -> None:
    assert match_device_name("Tesla P100-PCIE-16GB") is None
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


@pytest.mark.parametrize(("typed", "close"), [
    ("H10", ["H100-SXM", "H100-PCIe"]),
    ("V10", ["V100"]),
    ("rtx 3080", ["RTX-3090", "RTX-4090", "RTX-5090"]),
    ("l40", ["L40S", "L4"]),
    ("NVIDIDA H100 80GB HBM3e", ["H100-SXM"]),  # misspelt: no driver name, so a suggestion
])
def test_unknown_gpu_error_names_the_close_gpus_first(typed: str, close: list[str]) -> None:
    assert close_gpu_names(typed) == close
    with pytest.raises(OptplanError) as info:
        find_gpu(typed)
    message = str(info.value)
    assert message.startswith(f"unknown GPU '{typed}': did you mean {', '.join(close)}? (use --gpu with one of ")
    assert "\n" not in message and all(name in message for name in EXPECTED)


def test_unknown_gpu_error_for_h10_reads_exactly() -> None:
    known = ", ".join(gpu_catalogue())
    with pytest.raises(OptplanError, match="unknown GPU") as info:
        find_gpu("H10")
    assert str(info.value) == f"unknown GPU 'H10': did you mean H100-SXM, H100-PCIe? (use --gpu with one of {known})"


@pytest.mark.parametrize("typed", ["TPU v5p", "MI250", "x", "", "!!"])
def test_unknown_gpu_with_nothing_close_keeps_the_plain_message(typed: str) -> None:
    assert close_gpu_names(typed) == []
    with pytest.raises(OptplanError) as info:
        find_gpu(typed)
    assert str(info.value) == f"unknown GPU '{typed}': use --gpu with one of {', '.join(gpu_catalogue())}"


def test_close_gpu_names_are_catalogue_names_limited_and_unique() -> None:
    for typed in ("A10", "H1", "B100", "GH200", "a100 80", "H100 SXM6"):
        close = close_gpu_names(typed)
        assert len(close) == len(set(close)) <= 3
        assert set(close) <= EXPECTED
    assert close_gpu_names("A10", limit=1) == ["A100-80GB"]


def test_unknown_gpu_fix_wording_can_be_replaced() -> None:
    with pytest.raises(OptplanError) as info:
        find_gpu("H10", fix="set gpu to one of")
    message = str(info.value)
    assert "set gpu to one of A100-40GB" in message and "--gpu" not in message
    assert unknown_gpu_message("H10", fix="set gpu to one of") == message


def test_cluster_price_and_power_default_to_none_and_tdp() -> None:
    h100 = find_gpu("H100-SXM")
    cluster = Cluster(gpu=h100, gpus=16, gpus_per_node=8)
    assert cluster.price_per_gpu_hour is None and cluster.gpu_power_w is None
    assert cluster.power_w_per_gpu == h100.tdp_watts == 700
    assert cluster.inter_node_bandwidth_bytes_per_s == 50e9 and cluster.detected is False and cluster.nodes == 2
    custom = Cluster(gpu=h100, gpus=16, gpus_per_node=8, price_per_gpu_hour=2.5, gpu_power_w=550)
    assert custom.price_per_gpu_hour == 2.5 and custom.power_w_per_gpu == 550


def test_driver_names_find_their_catalogue_entry() -> None:
    """--gpu takes a GPU's name as nvidia-smi prints it; its memory size picks the variant."""
    from optplan.estimators.hardware import find_gpu, match_device_name

    assert find_gpu("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert find_gpu("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert find_gpu("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert find_gpu("NVIDIA H100 80GB HBM3e") == match_device_name("NVIDIA H100 80GB HBM3e")  # as detection maps it
    with pytest.raises(OptplanError, match="unknown GPU 'NVIDIA Quantum 9000'"):
        find_gpu("NVIDIA Quantum 9000")
