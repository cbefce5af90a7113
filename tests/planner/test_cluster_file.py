"""--cluster FILE.yaml: a good file gives the right Cluster; every bad one a one-line OptplanError."""

from __future__ import annotations

from pathlib import Path

import pytest

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.planner.cluster_file import KNOWN_KEYS, load_cluster_file

GOOD = "gpu: H100\ngpus_per_node: 8\nnodes: 4\n"


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_for(path: Path | str) -> str:
    with pytest.raises(OptplanError) as info:
        load_cluster_file(path)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --- good files ---------------------------------------------------------------------------------


def test_minimal_file_gives_catalogue_gpu_and_defaults(tmp_path: Path) -> None:
    cluster = load_cluster_file(write(tmp_path, GOOD))
    assert isinstance(cluster, Cluster)
    assert cluster.gpu == find_gpu("H100-SXM")
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes) == (32, 8, 4)
    assert cluster.inter_node_bandwidth_bytes_per_s == 50e9  # the Cluster default, untouched
    assert cluster.price_per_gpu_hour is None and cluster.gpu_power_w is None
    assert cluster.power_w_per_gpu == find_gpu("H100-SXM").tdp_watts == 700
    assert cluster.detected is False


def test_full_file_converts_bandwidths_exactly_and_carries_price_and_power(tmp_path: Path) -> None:
    text = (GOOD + "intra_node_bandwidth_GBps: 300\ninter_node_bandwidth_GBps: 400\n"
            "price_per_gpu_hour: 2.5\ngpu_power_w: 650\n")
    cluster = load_cluster_file(write(tmp_path, text))
    catalogue_h100 = find_gpu("H100-SXM")
    assert cluster.gpu.intra_node_bandwidth_bytes_per_s == 300e9
    assert cluster.gpu.name == "H100-SXM"
    assert cluster.gpu.model_dump(exclude={"intra_node_bandwidth_bytes_per_s"}) == catalogue_h100.model_dump(
        exclude={"intra_node_bandwidth_bytes_per_s"})
    assert catalogue_h100.intra_node_bandwidth_bytes_per_s == 450e9  # the catalogue entry is not modified
    assert cluster.inter_node_bandwidth_bytes_per_s == 50e9  # 400 GB/s per node / 8 GPUs
    assert cluster.price_per_gpu_hour == 2.5
    assert cluster.gpu_power_w == 650 and cluster.power_w_per_gpu == 650


@pytest.mark.parametrize(("per_node", "node_gbps", "per_gpu_bytes"), [
    (8, 400, 50e9), (4, 200, 50e9), (8, 3200 / 8, 50e9), (1, 25, 25e9), (3, 100, 100e9 / 3),
])
def test_inter_node_bandwidth_is_per_node_divided_by_gpus_per_node(
        tmp_path: Path, per_node: int, node_gbps: float, per_gpu_bytes: float) -> None:
    text = f"gpu: A100\ngpus_per_node: {per_node}\nnodes: 2\ninter_node_bandwidth_GBps: {node_gbps}\n"
    cluster = load_cluster_file(write(tmp_path, text))
    assert cluster.inter_node_bandwidth_bytes_per_s == per_gpu_bytes
    assert cluster.gpus == 2 * per_node


@pytest.mark.parametrize(("nodes", "per_node"), [(1, 1), (1, 8), (2, 4), (64, 8), (3, 2)])
def test_total_gpus_is_nodes_times_gpus_per_node(tmp_path: Path, nodes: int, per_node: int) -> None:
    cluster = load_cluster_file(write(tmp_path, f"gpu: H200\ngpus_per_node: {per_node}\nnodes: {nodes}\n"))
    assert (cluster.gpus, cluster.gpus_per_node, cluster.nodes) == (nodes * per_node, per_node, nodes)


def test_accepts_str_path(tmp_path: Path) -> None:
    assert load_cluster_file(str(write(tmp_path, GOOD))).gpus == 32


def test_gpu_aliases_and_bare_numbers_resolve_through_the_catalogue(tmp_path: Path) -> None:
    assert load_cluster_file(write(tmp_path, "gpu: h100 pcie\ngpus_per_node: 2\nnodes: 1\n")).gpu.name == "H100-PCIe"
    assert load_cluster_file(write(tmp_path, "gpu: 4090\ngpus_per_node: 2\nnodes: 1\n")).gpu.name == "RTX-4090"
    assert load_cluster_file(write(tmp_path, "gpu: '  L40S '\ngpus_per_node: 2\nnodes: 1\n")).gpu.name == "L40S"


def test_integral_float_counts_are_accepted_as_ints(tmp_path: Path) -> None:
    cluster = load_cluster_file(write(tmp_path, "gpu: H100\ngpus_per_node: 8.0\nnodes: 2.0\n"))
    assert cluster.gpus == 16 and isinstance(cluster.gpus, int) and isinstance(cluster.gpus_per_node, int)


def test_empty_optional_values_count_as_absent_and_zero_price_is_allowed(tmp_path: Path) -> None:
    text = GOOD + "intra_node_bandwidth_GBps:\ngpu_power_w: ~\nprice_per_gpu_hour: 0\n"
    cluster = load_cluster_file(write(tmp_path, text))
    assert cluster.gpu == find_gpu("H100-SXM")
    assert cluster.gpu_power_w is None and cluster.price_per_gpu_hour == 0


def test_comments_flow_style_and_bom_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes("\ufeff# my cluster\n{gpu: B200, gpus_per_node: 8, nodes: 16}  # 128 GPUs\n".encode())
    cluster = load_cluster_file(path)
    assert cluster.gpu.name == "B200" and cluster.gpus == 128


def test_cluster_stays_frozen_and_strict(tmp_path: Path) -> None:
    cluster = load_cluster_file(write(tmp_path, GOOD))
    with pytest.raises(ValueError):
        cluster.gpus = 1  # type: ignore[misc]
    with pytest.raises(ValueError):
        Cluster(gpu=find_gpu("H100"), gpus=8, gpus_per_node=8, bogus=1)  # type: ignore[call-arg]


def test_cluster_rejects_bad_price_and_power() -> None:
    h100 = find_gpu("H100")
    with pytest.raises(ValueError):
        Cluster(gpu=h100, gpus=8, gpus_per_node=8, price_per_gpu_hour=-1)
    with pytest.raises(ValueError):
        Cluster(gpu=h100, gpus=8, gpus_per_node=8, gpu_power_w=0)
    assert Cluster(gpu=h100, gpus=8, gpus_per_node=8, price_per_gpu_hour=0).price_per_gpu_hour == 0


def test_yaml_tags_are_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"gpu: !!python/object/apply:os.system ['touch {marker}']\ngpus_per_node: 8\nnodes: 1\n"
    message = error_for(write(tmp_path, text))
    assert message.startswith("cluster.yaml: invalid YAML at line 1")
    assert not marker.exists()


# --- unreadable files ---------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    message = error_for(path)
    assert message.startswith("nope.yaml: no such file") and str(path) in message and "--cluster" in message


def test_directory(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.mkdir()
    message = error_for(path)
    assert message.startswith("cluster.yaml: is a directory") and "file" in message


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, GOOD)

    def refuse(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    message = error_for(path)
    assert message.startswith("cluster.yaml: cannot read") and "Permission denied" in message
    assert "permissions" in message


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"gpu: H100\xff\n")
    assert error_for(path).startswith("cluster.yaml: not UTF-8 text")


# --- bad YAML and bad shape ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "line"), [
    ("gpu: H100\ngpus_per_node: 8\nnodes: 2: 3\n", 3),
    ("gpu: H100\n  gpus_per_node: 8\nnodes: 2\n", 2),
    ("gpu: [H100\ngpus_per_node: 8\n", 2),
    ("gpu: H100\ngpus_per_node: 8\nnodes: 1\n---\nnodes: 2\n", 4),
    ("gpu: H100\n\tnodes: 2\n", 2),
])
def test_invalid_yaml_names_the_line(tmp_path: Path, text: str, line: int) -> None:
    message = error_for(write(tmp_path, text))
    assert message.startswith(f"cluster.yaml: invalid YAML at line {line}: "), message
    assert "fix the syntax" in message


@pytest.mark.parametrize(("text", "kind"), [
    ("", "an empty file"), ("# only a comment\n", "an empty file"), ("- gpu: H100\n", "a list"),
    ("H100\n", "the text 'H100'"), ("8\n", "the value 8"),
])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    message = error_for(write(tmp_path, text))
    assert message.startswith(f"cluster.yaml: the top level must be a mapping of keys, got {kind}"), message
    assert "key: value" in message


def test_duplicate_key_is_rejected_with_its_line(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, GOOD + "nodes: 8\n"))
    assert message == "cluster.yaml: duplicate key 'nodes' at line 4: keep only one"


# --- keys ---------------------------------------------------------------------------------------


def test_unknown_key_lists_the_known_keys(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, GOOD + "gpu_count: 32\n"))
    assert message.startswith("cluster.yaml: unknown key 'gpu_count': use gpu, gpus_per_node, nodes, ")
    assert all(key in message for key in KNOWN_KEYS)
    assert "nodes x gpus_per_node" in message and "did you mean" not in message


@pytest.mark.parametrize(("typo", "meant"), [
    ("gpus_per_nodes", "gpus_per_node"), ("GPU", "gpu"), ("node", "nodes"),
    ("inter_node_bandwidth_gbps", "inter_node_bandwidth_GBps"), ("intra_bandwidth_GBps", "intra_node_bandwidth_GBps"),
    ("price_per_hour", "price_per_gpu_hour"), ("gpu_power", "gpu_power_w"),
])
def test_unknown_key_suggests_the_close_one(tmp_path: Path, typo: str, meant: str) -> None:
    text = "\n".join(line for line in GOOD.splitlines() if not line.startswith(f"{meant}:"))
    message = error_for(write(tmp_path, f"{text}\n{typo}: 1\n"))
    assert message.startswith(f"cluster.yaml: unknown key '{typo}': did you mean '{meant}'? (use gpu, "), message
    assert all(key in message for key in KNOWN_KEYS)


def test_total_count_key_is_not_mistaken_for_gpu(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, GOOD + "gpus: 32\n"))
    assert "unknown key 'gpus'" in message and "did you mean" not in message
    assert "nodes x gpus_per_node" in message


def test_non_string_key_is_unknown(tmp_path: Path) -> None:
    assert "unknown key '8'" in error_for(write(tmp_path, GOOD + "8: nodes\n"))


@pytest.mark.parametrize("key", ["gpu", "gpus_per_node", "nodes"])
def test_each_required_key_is_required(tmp_path: Path, key: str) -> None:
    text = "\n".join(line for line in GOOD.splitlines() if not line.startswith(f"{key}:"))
    message = error_for(write(tmp_path, text + "\n"))
    assert message.startswith(f"cluster.yaml: missing required key {key}: add e.g. '{key}: "), message


def test_all_missing_required_keys_are_named(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, "gpu: H100\n"))
    assert message == ("cluster.yaml: missing required keys gpus_per_node, nodes: "
                       "add e.g. 'gpus_per_node: 8', 'nodes: 2'")


# --- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("line", "expected"), [
    ("nodes: two", "nodes must be a number, got 'two'"),
    ("nodes: '2'", "nodes must be a number, got '2' (quoted, so YAML reads it as text: drop the quotes)"),
    ("nodes: true", "nodes must be a number, got the boolean true"),
    ("nodes: yes", "nodes must be a number, got the boolean true"),
    ("nodes:", "nodes must be a number, got no value"),
    ("nodes: [2]", "nodes must be a number, got a list"),
    ("nodes: 0", "nodes must be at least 1, got 0"),
    ("nodes: -2", "nodes must be at least 1, got -2"),
    ("nodes: 2.5", "nodes must be a whole number, got 2.5"),
    ("nodes: .inf", "nodes must be a finite number, got inf"),
    ("gpus_per_node: 0", "gpus_per_node must be at least 1, got 0"),
    ("gpus_per_node: 0.5", "gpus_per_node must be a whole number, got 0.5"),
    ("gpus_per_node: false", "gpus_per_node must be a number, got the boolean false"),
    ("intra_node_bandwidth_GBps: 0", "intra_node_bandwidth_GBps must be greater than 0, got 0"),
    ("intra_node_bandwidth_GBps: -450", "intra_node_bandwidth_GBps must be greater than 0, got -450"),
    ("intra_node_bandwidth_GBps: fast", "intra_node_bandwidth_GBps must be a number, got 'fast'"),
    ("inter_node_bandwidth_GBps: 0.0", "inter_node_bandwidth_GBps must be greater than 0, got 0"),
    ("inter_node_bandwidth_GBps: true", "inter_node_bandwidth_GBps must be a number, got the boolean true"),
    ("inter_node_bandwidth_GBps: .nan", "inter_node_bandwidth_GBps must be a finite number, got nan"),
    ("price_per_gpu_hour: -0.5", "price_per_gpu_hour must be at least 0, got -0.5"),
    ("price_per_gpu_hour: $2", "price_per_gpu_hour must be a number, got '$2'"),
    ("gpu_power_w: 0", "gpu_power_w must be greater than 0, got 0"),
    ("gpu_power_w: -700", "gpu_power_w must be greater than 0, got -700"),
    ("gpu_power_w: 700W", "gpu_power_w must be a number, got '700W'"),
])
def test_bad_numbers(tmp_path: Path, line: str, expected: str) -> None:
    key = line.split(":")[0]
    text = "\n".join(kept for kept in GOOD.splitlines() if not kept.startswith(f"{key}:"))
    message = error_for(write(tmp_path, f"{text}\n{line}\n"))
    assert message.startswith(f"cluster.yaml: {expected}: write e.g. '{key}: "), message


def test_exponent_without_dot_explains_the_yaml_trap(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, GOOD + "inter_node_bandwidth_GBps: 4e2\n"))
    assert "inter_node_bandwidth_GBps must be a number, got '4e2'" in message
    assert "1.0e+9" in message


def test_unknown_gpu_names_the_close_ones_and_the_key(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, "gpu: H10\ngpus_per_node: 8\nnodes: 1\n"))
    assert message.startswith("cluster.yaml: unknown GPU 'H10': did you mean H100-SXM, H100-PCIe? "), message
    assert "set gpu to one of A100-40GB" in message and "--gpu" not in message


def test_unknown_gpu_without_close_names(tmp_path: Path) -> None:
    message = error_for(write(tmp_path, "gpu: TPU v5p\ngpus_per_node: 8\nnodes: 1\n"))
    assert message.startswith("cluster.yaml: unknown GPU 'TPU v5p': set gpu to one of A100-40GB, ")
    assert "did you mean" not in message


@pytest.mark.parametrize(("line", "shown"), [
    ("gpu: [H100]", "a list"), ("gpu: true", "the boolean true"), ("gpu: ''", "''"), ("gpu:", "no value"),
    ("gpu: 100.5", "100.5"),
])
def test_gpu_must_be_a_name(tmp_path: Path, line: str, shown: str) -> None:
    message = error_for(write(tmp_path, f"{line}\ngpus_per_node: 8\nnodes: 1\n"))
    assert message == f"cluster.yaml: gpu must be a GPU name, got {shown}: write e.g. 'gpu: H100-SXM'"
