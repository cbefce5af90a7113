"""Checks shared by the tests of the benchmarks' published-data files (benchmarks/data/*.json)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def citation_problems(rows: list[dict[str, Any]], sources: dict[str, Any],
                      check_row: Callable[[dict[str, Any], dict[str, Any]], list[str]],
                      source_keys: Iterable[str]) -> list[str]:
    """What is wrong with a data file: malformed rows (the benchmark's own ``check_row``), duplicate ids, and
    sources without one of ``source_keys``; empty when every row is complete and cited."""
    problems = [f"{row.get('id', '?')}: {p}" for row in rows for p in check_row(row, sources)]
    ids = [row["id"] for row in rows]
    problems += [f"duplicate id {i}" for i in sorted({i for i in ids if ids.count(i) > 1})]
    problems += [f"source {name} has no {key}" for name, source in sources.items() for key in source_keys
                 if not source.get(key)]
    return problems
