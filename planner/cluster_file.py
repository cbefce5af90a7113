"""Read a cluster description from a YAML file (the CLI's ``--cluster FILE.yaml``).

The file is data only: it is parsed with ``yaml.safe_load`` (no tags, no code). Keys, all at the top
level of one mapping:

=============================  ========  =====================================================
key                            required  meaning
=============================  ========  =====================================================
``gpu``                        yes       catalogue name or alias (``find_gpu``), e.g. H100-SXM
``gpus_per_node``              yes       GPUs per node, whole number >= 1
``nodes``                      yes       nodes, whole number >= 1; total GPUs = nodes x gpus_per_node
``intra_node_bandwidth_GBps``  no        per GPU, one direction, GB/s (1 GB = 1e9 bytes): replaces
                                         the catalogue's NVLink/PCIe figure
``inter_node_bandwidth_GBps``  no        per NODE, one direction, GB/s: stored per GPU, i.e.
                                         divided by gpus_per_node
``price_per_gpu_hour``         no        USD per GPU-hour, >= 0
``gpu_power_w``                no        watts per GPU for energy, > 0 (default: datasheet TDP)
=============================  ========  =====================================================

An optional key written with no value (``price_per_gpu_hour:``) counts as absent. Every problem raises
``OptplanError`` with one line that starts with the file name and says what to change.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import yaml

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu

GB = 1e9  # bytes per GB (decimal, as link datasheets use)

REQUIRED_KEYS: tuple[str, ...] = ("gpu", "gpus_per_node", "nodes")
OPTIONAL_KEYS: tuple[str, ...] = (
    "intra_node_bandwidth_GBps", "inter_node_bandwidth_GBps", "price_per_gpu_hour", "gpu_power_w",
)
KNOWN_KEYS: tuple[str, ...] = REQUIRED_KEYS + OPTIONAL_KEYS

EXAMPLES: Mapping[str, str] = MappingProxyType({
    "gpu": "H100-SXM", "gpus_per_node": "8", "nodes": "2", "intra_node_bandwidth_GBps": "450",
    "inter_node_bandwidth_GBps": "400", "price_per_gpu_hour": "2.5", "gpu_power_w": "700",
})

# Keys people write for a total GPU count, which the file expresses as nodes x gpus_per_node.
_TOTAL_COUNT_KEYS = frozenset({"gpus", "num_gpus", "n_gpus", "gpu_count", "total_gpus", "world_size"})


def load_cluster_file(path: Path | str) -> Cluster:
    """Parse a cluster YAML file into a ``Cluster`` (total GPUs = nodes x gpus_per_node).

    Bandwidths in the file are GB/s (1e9 bytes/s), one direction. ``intra_node_bandwidth_GBps`` is per
    GPU and replaces the GPU's ``intra_node_bandwidth_bytes_per_s`` (on a copy of the catalogue
    entry). ``inter_node_bandwidth_GBps`` is per NODE; the Cluster field
    ``inter_node_bandwidth_bytes_per_s`` is per GPU, so it is stored as node bytes/s / gpus_per_node.
    ``price_per_gpu_hour`` (USD) and ``gpu_power_w`` (watts per GPU) are carried as given.

    Raises OptplanError (one line, starting with the file name) for any unreadable or invalid file.
    """
    file = Path(path)
    data = _read_mapping(file)
    name = file.name
    _check_keys(data, name)
    per_node = _count(data, "gpus_per_node", name)
    nodes = _count(data, "nodes", name)
    gpu = _gpu(data, name)
    intra = _optional_number(data, "intra_node_bandwidth_GBps", name, allow_zero=False)
    inter = _optional_number(data, "inter_node_bandwidth_GBps", name, allow_zero=False)
    if intra is not None:
        gpu = gpu.model_copy(update={"intra_node_bandwidth_bytes_per_s": intra * GB})
    links = {} if inter is None else {"inter_node_bandwidth_bytes_per_s": inter * GB / per_node}
    return Cluster(
        gpu=gpu, gpus=nodes * per_node, gpus_per_node=per_node,
        price_per_gpu_hour=_optional_number(data, "price_per_gpu_hour", name, allow_zero=True),
        gpu_power_w=_optional_number(data, "gpu_power_w", name, allow_zero=False),
        **links,
    )


def _read_text(file: Path) -> str:
    """The file's text (UTF-8, an optional BOM dropped), or OptplanError saying why it cannot be read."""
    name = file.name
    if file.is_dir():
        raise OptplanError(f"{name}: is a directory ({file}), not a file: pass the cluster YAML file itself")
    try:
        raw = file.read_bytes()
    except FileNotFoundError as exc:
        raise OptplanError(f"{name}: no such file ({file}): check the --cluster path") from exc
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OptplanError(f"{name}: cannot read the file ({reason}): check its path and permissions") from exc
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise OptplanError(f"{name}: not UTF-8 text (byte {exc.start}): save the file as UTF-8") from exc


def _read_mapping(file: Path) -> dict[object, object]:
    """The file's top-level mapping, with duplicate keys rejected."""
    name = file.name
    text = _read_text(file)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # a tag such as !!python/object is refused by safe_load: the file is data only, never code
        tag = isinstance(exc, yaml.constructor.ConstructorError) and "could not determine a constructor" in str(exc)
        fix = ("the file is plain data, no tags: remove the '!!' tag and write a plain value" if tag
               else "fix the syntax (one 'key: value' per line)")
        raise OptplanError(f"{name}: invalid YAML{_yaml_where(exc)}: {_yaml_problem(exc)}: {fix}") from exc
    if not isinstance(data, dict):
        raise OptplanError(f"{name}: the top level must be a mapping of keys, got {_kind(data)}: "
                           f"write one 'key: value' per line, e.g. 'gpu: H100-SXM'")
    _check_duplicates(text, name)
    return data


def _yaml_where(exc: yaml.YAMLError) -> str:
    """' at line N' (1-based) for a YAML error that carries a position, else ''."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    return "" if mark is None else f" at line {mark.line + 1}"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's own short description of the problem, on one line."""
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or type(exc).__name__
    return " ".join(str(problem).split())


def _check_duplicates(text: str, name: str) -> None:
    """Reject a top-level key written twice (safe_load would silently keep the last one)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes only: nothing is constructed
    seen: set[tuple[str, str]] = set()
    for key_node, _ in getattr(node, "value", []):
        if not isinstance(key_node, yaml.ScalarNode):
            continue  # safe_load has already rejected unhashable keys
        key = (key_node.tag, key_node.value)  # the tag keeps 1 and "1" apart
        if key in seen:
            raise OptplanError(f"{name}: duplicate key '{key_node.value}' at line "
                               f"{key_node.start_mark.line + 1}: keep only one")
        seen.add(key)


def _check_keys(data: Mapping[object, object], name: str) -> None:
    """Reject unknown keys (suggesting the close known one) and missing required keys."""
    known = ", ".join(KNOWN_KEYS)
    for key in data:
        if key in KNOWN_KEYS:
            continue
        hint = _close_key(str(key))
        if hint is not None:
            raise OptplanError(f"{name}: unknown key '{key}': did you mean '{hint}'? (use {known})")
        total = " (the GPU count is nodes x gpus_per_node)" if str(key).lower() in _TOTAL_COUNT_KEYS else ""
        raise OptplanError(f"{name}: unknown key '{key}': use {known}{total}")
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        examples = ", ".join(f"'{key}: {EXAMPLES[key]}'" for key in missing)
        plural = "s" if len(missing) > 1 else ""
        raise OptplanError(f"{name}: missing required key{plural} {', '.join(missing)}: add e.g. {examples}")


def _close_key(key: str) -> str | None:
    """The known key closest to ``key`` (case-insensitive), or None when none is close."""
    if key.lower() in _TOTAL_COUNT_KEYS:
        return None  # 'gpus' is close to 'gpu' in spelling, not in meaning
    lowered = {known.lower(): known for known in KNOWN_KEYS}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def _gpu(data: Mapping[object, object], name: str) -> GPUSpec:
    """The catalogue entry named by ``gpu`` (a string; a bare number like 4090 is read as its name)."""
    value = data["gpu"]
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise OptplanError(f"{name}: gpu must be a GPU name, got {_show(value)}: "
                           f"write e.g. 'gpu: {EXAMPLES['gpu']}'")
    try:
        return find_gpu(value.strip(), fix="set gpu to one of")
    except OptplanError as exc:
        raise OptplanError(f"{name}: {exc}") from exc


def _count(data: Mapping[object, object], key: str, name: str) -> int:
    """A required whole number >= 1 (an integral float such as 2.0 is accepted as 2)."""
    value = _number(data[key], key, name)
    if not float(value).is_integer():
        raise _bad(name, key, "a whole number", data[key])
    if value < 1:
        raise _bad(name, key, "at least 1", data[key])
    return int(value)


def _optional_number(data: Mapping[object, object], key: str, name: str, *, allow_zero: bool) -> float | None:
    """An optional finite number, > 0 (or >= 0 with ``allow_zero``); None when absent or empty."""
    raw = data.get(key)
    if raw is None:
        return None
    value = float(_number(raw, key, name))
    if value < 0 or (value == 0 and not allow_zero):
        raise _bad(name, key, "at least 0" if allow_zero else "greater than 0", raw)
    return value


def _number(value: object, key: str, name: str) -> int | float:
    """``value`` as a finite int or float; booleans, strings and everything else are rejected."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, key, "a number", value)
    if not math.isfinite(value):
        raise _bad(name, key, "a finite number", value)
    return value


def _bad(name: str, key: str, requirement: str, value: object) -> OptplanError:
    """The one-line error for a key whose value breaks ``requirement``."""
    hint = ""
    if isinstance(value, str) and _parses_as_float(value):
        hint = (" (YAML reads numbers like 1e9 without a dot as text: write 1.0e+9 or the plain digits)"
                if "e" in value.lower() else " (quoted, so YAML reads it as text: drop the quotes)")
    return OptplanError(f"{name}: {key} must be {requirement}, got {_show(value)}{hint}: "
                        f"write e.g. '{key}: {EXAMPLES[key]}'")


def _parses_as_float(text: str) -> bool:
    """True when Python would read ``text`` as a number (the YAML 1.1 '1e9 is a string' trap)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def _show(value: object) -> str:
    """A short description of a YAML value for an error message."""
    if value is None:
        return "no value"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return repr(value)
    return _kind(value)


def _kind(value: object) -> str:
    """'a list', 'a mapping', 'an empty file', ... for the top-level shape of a YAML document."""
    if value is None:
        return "an empty file"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the text {value!r}"
    return f"the value {value!r}"
