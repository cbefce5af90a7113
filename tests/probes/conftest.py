"""Fixtures for the model-file probes: example files, tmp model files, small GPTs."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as module ``optplan_example_<name>`` (cached)."""
    mod_name = f"optplan_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """Write a model file into tmp_path (dedented source) and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


SMALL_GPT = dict(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=64)


def small_gpt_source(**overrides: object) -> str:
    """A model file building a small GPT from examples/gpt2.py (seq 64, vocab 512)."""
    cfg = {**SMALL_GPT, **overrides}
    return textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("optplan_example_gpt2", {str(EXAMPLES / "gpt2.py")!r})
        gpt2 = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = gpt2
        spec.loader.exec_module(gpt2)
        import torch

        CFG = {cfg!r}
        OPTPLAN = {{"seq_len": {cfg["block_size"]}}}

        def build_model():
            return gpt2.build_model(**CFG)

        def example_batch(batch_size, seq_len):
            return torch.randint(0, CFG["vocab_size"], (batch_size, seq_len))

        loss_fn = gpt2.loss_fn
        """)


@pytest.fixture
def example() -> Callable[[str], ModuleType]:
    """``example("gpt2")`` imports examples/gpt2.py."""
    return load_example


@pytest.fixture
def small_gpt_cfg() -> dict[str, int]:
    return dict(SMALL_GPT)


@pytest.fixture
def small_gpt_file(write_model: Callable[..., Path]) -> Path:
    """A model file with a 4-layer GPT (n_embd 128, 4 heads, vocab 512, seq 64)."""
    return write_model(small_gpt_source(), "small_gpt.py")
