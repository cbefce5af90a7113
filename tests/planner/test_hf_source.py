"""``--hf``: Hugging Face configs found without the network, the model file optplan writes for them, and what
it does end to end (profile, recommend --out, the exported train.py on 2 gloo ranks against the prediction)."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.estimators.errors import OptplanError
from optplan.planner.hf_source import (
    DEFAULT_HF_SEQ_LEN,
    find_hf_config,
    generated_model_file,
    hf_model_file_text,
    write_hf_model_file,
)
from optplan.tui.cli import app

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
"""A 2-layer Llama config (214,336 parameters: untied 1000 x 64 embedding and head, 2 blocks)."""


def _folder(tmp_path: Path, name: str = "tiny-llama", doc: dict | None = None) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(doc or TINY_LLAMA), encoding="utf-8")
    return folder


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An HF hub cache (huggingface_hub's layout) holding acme/tiny-llama at two revisions, refs/main naming one."""
    root = tmp_path / "hub"
    repo = root / "models--acme--tiny-llama"
    for rev, layers in (("aaa111", 2), ("bbb222", 3)):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": layers}), encoding="utf-8")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa111", encoding="utf-8")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "optplan-cache"))
    return root


def test_a_config_file_a_folder_and_a_cached_hub_id(tmp_path: Path, hub: Path) -> None:
    folder = _folder(tmp_path)
    by_folder = find_hf_config(str(folder))
    by_file = find_hf_config(str(folder / "config.json"))
    assert by_folder == by_file.model_copy(update={"spec": str(folder)})
    assert (by_folder.name, by_folder.model_type, by_folder.model_class) == ("tiny-llama", "llama", "LlamaForCausalLM")
    assert (by_folder.vocab_size, by_folder.max_positions) == (1000, 128)
    cached = find_hf_config("acme/tiny-llama")
    assert cached.name == "tiny-llama" and "/snapshots/aaa111/" in cached.config_path  # refs/main first
    (hub / "models--acme--tiny-llama" / "refs" / "main").write_text("gone", encoding="utf-8")
    assert "/snapshots/" in find_hf_config("acme/tiny-llama").config_path  # else a snapshot that has one
    assert find_hf_config(str(folder), "AutoModelForCausalLM").model_class == "AutoModelForCausalLM"


@pytest.mark.parametrize("make, spec, match", [
    (None, "acme/not-cached", "not in the local Hugging Face cache"),
    (None, "no/such/path.json", "no such file or folder"),
    ("empty-folder", "", "the folder has no config.json"),
    ("not-json", "", "is not readable JSON"),
    ("no-model-type", "", 'no "model_type"'),
])
def test_bad_hf_specs_are_one_line_with_the_fix(tmp_path: Path, hub: Path, make: str | None, spec: str,
                                                match: str) -> None:
    if make == "empty-folder":
        spec = str(tmp_path / "empty")
        Path(spec).mkdir()
    elif make == "not-json":
        spec = str(tmp_path / "config.json")
        Path(spec).write_text("{not json", encoding="utf-8")
    elif make == "no-model-type":
        spec = str(tmp_path / "other.json")
        Path(spec).write_text('{"learning_rate": 0.1}', encoding="utf-8")
    with pytest.raises(OptplanError, match=match) as info:
        find_hf_config(spec)
    assert "\n" not in str(info.value)
    if spec == "acme/not-cached":
        assert "never downloads" in str(info.value) and "huggingface-cli download acme/not-cached" in str(info.value)


def test_a_bad_class_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OptplanError, match="not a class name"):
        find_hf_config(str(_folder(tmp_path)), "os.system")


def test_the_generated_model_file(tmp_path: Path) -> None:
    long = {**TINY_LLAMA, "max_position_embeddings": 131072}
    source = find_hf_config(str(_folder(tmp_path, doc=long)))
    text = hf_model_file_text(source)
    assert f"'seq_len': {DEFAULT_HF_SEQ_LEN}" in text and "import optplan" not in text  # capped; no optplan needed
    assert "def example_batch" in text and "return output.loss" in text  # a causal LM: its own loss
    path = write_hf_model_file(source, tmp_path / "gen")
    py_compile.compile(str(path), doraise=True)
    assert write_hf_model_file(source, tmp_path / "gen") == path and len(list((tmp_path / "gen").glob("*.py"))) == 1
    assert generated_model_file(path) == (path.name, text)
    assert generated_model_file(Path(__file__)) is None
    encoder = find_hf_config(str(_folder(tmp_path, "enc", {"model_type": "bert", "architectures": ["BertModel"]})))
    assert "def example_batch" not in hf_model_file_text(encoder)  # no labels: optplan infers the batch and loss


# --------------------------------------------------------------------------------------------------
# end to end (transformers builds the model in the profiler child)
# --------------------------------------------------------------------------------------------------
runner = CliRunner()


def test_profile_and_errors_through_the_cli(tmp_path: Path, hub: Path) -> None:
    pytest.importorskip("transformers")
    r = runner.invoke(app, ["profile", "--hf", "acme/tiny-llama", "--seq-len", "64", "--json"])
    assert r.exit_code == 0, r.output
    prof = json.loads(r.output)
    assert prof["name"] == "tiny-llama" and prof["model_class"] == "LlamaForCausalLM"
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k and v (2 kv heads of 16), o
    layer = attention + 3 * 64 * 160 + 2 * 64  # + gate/up/down and two RMSNorms
    assert prof["params"] == 2 * 1000 * 64 + 2 * layer + 64 == 214_336  # untied embedding and head, final norm
    assert prof["repeated_block"]["class_name"] == "LlamaDecoderLayer" and prof["seq_len"] == 64
    r = runner.invoke(app, ["profile", "--hf", "acme/tiny-llama", "--hf-class", "NoSuchModel"])
    assert r.exit_code == 2 and "has no class NoSuchModel" in r.output and "pass --hf-class" in r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["profile", "examples/mlp.py", "--hf", "acme/tiny-llama"])
    assert r.exit_code == 2 and "give exactly one of a model FILE, --hf" in r.output
    r = runner.invoke(app, ["profile", "examples/mlp.py", "--hf-class", "LlamaForCausalLM"])
    assert r.exit_code == 2 and "--hf-class picks the class of an --hf model" in r.output
    # a config transformers refuses: the fix is in the config, not in the model file optplan generated from it
    bad = _folder(tmp_path, "bad-heads", {**TINY_LLAMA, "num_attention_heads": 3})
    r = runner.invoke(app, ["profile", "--hf", str(bad)])
    assert r.exit_code == 2 and "from the config raised" in r.output, r.output
    assert "fix its values in" in r.output and "run cleanly" not in r.output and "optplan/hf/" not in r.output


def test_recommend_out_is_self_contained_and_train_py_matches_the_prediction(tmp_path: Path, hub: Path) -> None:
    """The exported train.py builds the --hf model from the generated file beside it (the optplan cache removed),
    trains 2 gloo ranks, and its peak live bytes match the plan's CPU prediction."""
    pytest.importorskip("transformers")
    out = tmp_path / "plan"
    r = runner.invoke(app, ["recommend", "--hf", "acme/tiny-llama", "--gpu", "H100-SXM", "--gpus", "2",
                            "--seq-len", "64", "--global-batch", "4", "--precision", "bf16", "--engine", "torch",
                            "--no-probe", "--out", str(out)])
    assert r.exit_code == 0, r.output
    generated = [p for p in out.iterdir() if p.name.startswith("tiny_llama_")]
    assert len(generated) == 1 and (out / "train.py").is_file()
    for p in (tmp_path / "optplan-cache" / "hf").iterdir():
        p.unlink()  # train.py must find the model file beside itself, by name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "optplan.probes.runtime_child", "--train-script", "train.py", "--",
           "--device", "cpu", "--steps", "3", "--measurements", "m.json"]
    run = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads((out / "m.json").read_text())
    measured, predicted = doc["measured"]["peak_allocated_bytes"], doc["plan"]["prediction"]["cpu_allocated_bytes"]
    assert measured == pytest.approx(predicted, rel=0.02)


TINY_VIT = {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": 32,
            "patch_size": 8, "num_channels": 3, "id2label": {str(i): f"c{i}" for i in range(5)}}


def test_an_image_classifier_gets_pixels_and_labels(tmp_path: Path) -> None:
    """Vision configs take the same path: random pixel_values at the config's size and class labels; the model's own
    loss; no sequence length."""
    transformers = pytest.importorskip("transformers")
    source = find_hf_config(str(_folder(tmp_path, "vit", TINY_VIT)))
    assert (source.image_size, source.num_channels, source.num_labels) == (32, 3, 5)
    text = hf_model_file_text(source)
    assert "seq_len" not in text.split("OPTPLAN = ")[1].splitlines()[0]
    namespace: dict = {}
    exec(compile(text, "vit.py", "exec"), namespace)  # noqa: S102 - our own generated file
    model = namespace["build_model"]()
    assert isinstance(model, transformers.ViTForImageClassification)
    batch = namespace["example_batch"](2, 0)
    assert tuple(batch["pixel_values"].shape) == (2, 3, 32, 32) and int(batch["labels"].max()) < 5
    loss = namespace["loss_fn"](model(**batch), batch)
    assert loss.ndim == 0 and bool(loss.isfinite())


def test_an_image_classifier_profiles_and_plans(tmp_path: Path, hub: Path) -> None:
    pytest.importorskip("transformers")
    folder = _folder(tmp_path, "vit", TINY_VIT)
    r = runner.invoke(app, ["estimate", "--hf", str(folder), "--gpu", "RTX-4090", "--gpus", "1", "--mbs", "4",
                            "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["memory"]["fits"] and doc["memory"]["activations_bytes"] > 0


def test_a_sliding_window_model_profiles_without_a_generation_cache(tmp_path: Path, hub: Path) -> None:
    """Gemma 2 past its sliding window: with transformers' generation cache on, backward fails on a broadcast of the
    cached keys; the generated model file turns the cache off, as training does."""
    pytest.importorskip("transformers")
    doc = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 2,
           "vocab_size": 500, "max_position_embeddings": 512, "sliding_window": 128}
    r = runner.invoke(app, ["profile", "--hf", str(_folder(tmp_path, "gemma2", doc)), "--seq-len", "256", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["model_class"] == "Gemma2ForCausalLM"


def test_gpt2_without_its_positions_profiles_at_its_class_default_and_errors_name_the_hf_spec(tmp_path: Path,
                                                                                             hub: Path) -> None:
    """A GPT-2 config.json that names no n_positions: the generated file reads GPT2Config's default (1024) instead of
    profiling at 4096 positions the model does not have, and profiles (GPT-2 with the generation cache on fails in a
    checkpointed recompute: NO_CACHE_MODEL_TYPES). An error in the profile names ``--hf SPEC``, not the cache file."""
    pytest.importorskip("transformers")
    doc = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
           "vocab_size": 500}
    folder = _folder(tmp_path, "gpt2", doc)
    text = hf_model_file_text(find_hf_config(str(folder)))
    assert "'seq_len': _default_seq_len()" in text and "use_cache = False" in text
    r = runner.invoke(app, ["profile", "--hf", str(folder), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["seq_len"] == 1024
    r = runner.invoke(app, ["profile", "--hf", str(folder), "--seq-len", "2048"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --hf {folder}: sequence length 2048"), r.stderr
    assert "1024 positions" in r.stderr and ".cache" not in r.stderr
