"""The text of a model file that builds a reduced ``examples/<name>.py`` (the benchmarks' and the tests' models).

The file loads the example by path (as ``optplan_example_<name>``, bound to the name ``<name>``, so that code
appended to it can patch the example's classes), builds ``build_model(size, **SHAPE)``, draws token ids below the
reduced configuration's vocabulary, and takes the example's ``loss_fn``. One writer for benchmarks/
fidelity_cpu_memory.py, fidelity_suite.py, compiled_loss_cpu.py and tests/probes/conftest.py.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example_source(example: str, size: str, shape: Mapping[str, object] | None,
                   optplan: Mapping[str, object]) -> str:
    """The model file's text: examples/``example``.py's ``build_model(size, **shape)`` with the ``OPTPLAN``
    contract ``optplan`` (``seq_len`` and the like). ``example`` must name a file of examples/ (an identifier)."""
    if not example.isidentifier() or not (EXAMPLES / f"{example}.py").is_file():
        raise ValueError(f"no examples/{example}.py to wrap")
    return textwrap.dedent(f"""
        import importlib.util, sys
        import torch
        spec = importlib.util.spec_from_file_location("optplan_example_{example}", {str(EXAMPLES / f"{example}.py")!r})
        {example} = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = {example}
        spec.loader.exec_module({example})

        SHAPE = {dict(shape or {})!r}
        OPTPLAN = {dict(optplan)!r}

        def build_model():
            return {example}.build_model({size!r}, **SHAPE)

        def example_batch(batch_size, seq_len):
            return torch.randint(0, {example}.make_config({size!r}, **SHAPE).vocab_size, (batch_size, seq_len))

        loss_fn = {example}.loss_fn
        """)


__all__ = ["EXAMPLES", "example_source"]
