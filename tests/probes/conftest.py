"""Fixtures for the model-file probes: example files, tmp model files, small GPTs."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from factories import load_benchmark

from optplan.probes.device_lock import DEVICE_LOCK_ENV, held, lock_from_env
from optplan.probes.host_quiet import QUIET_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
example_source = load_benchmark("example_files.py").example_source  # the benchmarks' writer of model files


@pytest.fixture(autouse=True)
def _gpu_test_holds_the_device_lock(request: pytest.FixtureRequest,
                                    monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A GPU test run beside other probes (``$OPTPLAN_DEVICE_LOCK``: the campaign's gpu_tests beside its fidelity
    section) holds the device lock for its whole body, as one probe would, so that its figures (the device's free
    memory, the allocator's peaks) are its own. Its probes run without the variable (they would wait for this
    process), and outside the campaign's quiet group (probes/host_quiet.py). Without the variable, or for a test not
    marked ``gpu``: nothing."""
    path = lock_from_env()
    if path is None or request.node.get_closest_marker("gpu") is None:
        yield
        return
    monkeypatch.delenv(DEVICE_LOCK_ENV)
    monkeypatch.delenv(QUIET_ENV, raising=False)  # its probes time nothing the campaign compares: they stop no one
    with held(path):
        yield


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


SMALL_LLAMA = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256)


def small_llama_source(seq_len: int = 32, **overrides: object) -> str:
    """A model file building a small Llama from examples/llama.py (grouped-query attention: it repeats its K/V heads
    before SDPA), token batches below its vocabulary."""
    return example_source("llama", "1B", {**SMALL_LLAMA, **overrides}, {"seq_len": seq_len})


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


# ---------------------------------------------------------------------------------------------------
# runtime probe (tests/probes/test_runtime_probe.py, test_distributed_probe.py)
# ---------------------------------------------------------------------------------------------------
TINY_TOKEN_MODEL = """
import os, signal, time
import torch
import torch.nn as nn
import torch.nn.functional as F

MODE = os.environ.get("PROBE_TEST_MODE", "ok")   # how forward misbehaves (tests set it per probe)
BAD_RANK = int(os.environ.get("PROBE_TEST_RANK", "-1"))  # only this rank misbehaves (-1: every rank)
WIDTH = int(os.environ.get("PROBE_TEST_WIDTH", "64"))
DEPTH = int(os.environ.get("PROBE_TEST_DEPTH", "3"))
VOCAB = 128
OPTPLAN = {"seq_len": 32}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        rank = int(os.environ.get("RANK", "0"))
        if "PROBE_TEST_PID_FILE" in os.environ:
            with open(os.environ["PROBE_TEST_PID_FILE"], "a") as fh:
                fh.write(f"{os.getpid()}\\n")
        if MODE != "ok" and BAD_RANK in (-1, rank):
            if MODE == "raise":
                raise RuntimeError("boom in forward")
            if MODE == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if MODE == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "exit":
                os._exit(7)
            if MODE == "sleep":
                time.sleep(3600)
            if MODE == "slow":
                time.sleep(0.2)
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        if MODE == "nan" and BAD_RANK in (-1, rank):
            out = out * float("nan")  # every parameter still gets a gradient (DDP needs that)
        return out


def build_model():
    return TinyLM()


def loss_fn(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
"""
"""A small token model (embedding, DEPTH residual MLP blocks of class ``Block``, head) whose forward
misbehaves as the environment says: PROBE_TEST_MODE = raise | nan | segv | sigkill | exit | sleep | slow
(on rank PROBE_TEST_RANK only, when set); every forward appends its pid to PROBE_TEST_PID_FILE when set."""


@pytest.fixture
def tiny_lm_file(write_model: Callable[..., Path]) -> Path:
    """A model file with :data:`TINY_TOKEN_MODEL` (repeated block class ``Block``)."""
    return write_model(TINY_TOKEN_MODEL, "tiny_lm.py")


@pytest.fixture(scope="module")
def tiny_lm_module_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:data:`TINY_TOKEN_MODEL` in a file shared by one test module (for module-scoped probe results)."""
    path = tmp_path_factory.mktemp("tiny_lm") / "tiny_lm.py"
    path.write_text(textwrap.dedent(TINY_TOKEN_MODEL))
    return path


TINY_HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                 "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_hidden_layers": 3, "vocab_size": 500, "max_position_embeddings": 128,
                 "tie_word_embeddings": False}
"""A 3-layer Llama config (hidden 64, MLP 160, GQA 4/2) for the LoRA and quantised-base profile tests."""


@pytest.fixture(scope="module")
def tiny_hf_llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model file ``optplan --hf`` writes for :data:`TINY_HF_LLAMA` (needs transformers)."""
    import json

    from optplan.planner.hf_source import find_hf_config, write_hf_model_file

    folder = tmp_path_factory.mktemp("tiny-hf-llama")
    (folder / "config.json").write_text(json.dumps(TINY_HF_LLAMA), encoding="utf-8")
    return write_hf_model_file(find_hf_config(str(folder)), folder)
