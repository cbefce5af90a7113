"""``--hf`` with a timm config (the timm/... hub repositories: ``architecture`` + ``pretrained_cfg``, no
``model_type``): read as transformers reads it, built by its TimmWrapperForImageClassification over
``timm.create_model``, profiled, planned, and trained on the CPU within 2 % of the prediction."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from optplan.estimators.errors import OptplanError
from optplan.planner.hf_source import (
    TIMM_CLASS,
    TIMM_MODEL_TYPE,
    find_hf_config,
    hf_model_file,
    write_hf_model_file,
)
from optplan.tui.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
VIT_TINY = {"architecture": "vit_tiny_patch16_224", "num_classes": 10, "global_pool": "token",
            "pretrained_cfg": {"tag": "augreg_in21k_ft_in1k", "input_size": [3, 224, 224], "num_classes": 1000,
                               "first_conv": "patch_embed.proj", "classifier": "head"}}
"""A timm hub config as timm writes it (``push_to_hf_hub``): top-level num_classes over the pretrained one."""


def _folder(tmp_path: Path, doc: dict, name: str = "vit_tiny") -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


def test_a_timm_config_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    source = find_hf_config(str(_folder(tmp_path, VIT_TINY)))
    assert (source.model_type, source.model_class) == (TIMM_MODEL_TYPE, TIMM_CLASS)
    assert (source.image_size, source.num_channels, source.num_labels) == (224, 3, 10)  # the top-level classes win
    resized = {**VIT_TINY, "model_args": {"img_size": 96, "in_chans": 1}}
    small = find_hf_config(str(_folder(tmp_path, resized, "small")))
    assert (small.image_size, small.num_channels) == (96, 1)  # model_args over pretrained_cfg.input_size
    assert find_hf_config(str(_folder(tmp_path, VIT_TINY, "named")), TIMM_CLASS).model_class == TIMM_CLASS
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "vit_tiny"))
    assert config.model_type == TIMM_MODEL_TYPE and config.num_labels == 10  # transformers' own reading agrees


@pytest.mark.parametrize("doc, hf_class, match", [
    ({k: v for k, v in VIT_TINY.items() if k != "architecture"}, None, 'no "architecture"'),
    ({**VIT_TINY, "num_classes": 0}, None, "feature extractor"),
    (VIT_TINY, "ViTForImageClassification", "drop --hf-class"),
])
def test_bad_timm_configs_are_one_line_with_the_fix(tmp_path: Path, doc: dict, hf_class: str | None,
                                                    match: str) -> None:
    with pytest.raises(OptplanError, match=match) as info:
        find_hf_config(str(_folder(tmp_path, doc)), hf_class)
    assert "\n" not in str(info.value)


def test_a_timm_config_without_timm_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a))
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(OptplanError, match="pip install timm"):
        hf_model_file(str(_folder(tmp_path, VIT_TINY)))


def test_the_profile_is_timm_s_model_and_lora_finds_its_projections(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    timm = pytest.importorskip("timm")
    import torch

    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    folder = _folder(tmp_path, VIT_TINY)
    with torch.device("meta"):
        expected = sum(p.numel() for p in timm.create_model("vit_tiny_patch16_224", num_classes=10).parameters())
    r = runner.invoke(app, ["profile", "--hf", str(folder), "--json"])
    assert r.exit_code == 0, r.output
    prof = json.loads(r.output)
    assert prof["model_class"] == TIMM_CLASS and prof["params"] == expected
    assert prof["repeated_block"]["class_name"] == "Block" and prof["repeated_block"]["count"] == 12
    r = runner.invoke(app, ["estimate", "--hf", str(folder), "--finetune", "lora", "--gpu", "RTX-4090", "--gpus", "1",
                            "--mbs", "32", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["memory"]["fits"] and doc["memory"]["activations_bytes"] > 0
    assert any("48 adapted layers" in note for note in doc["notes"])  # qkv, proj, fc1, fc2 in each of 12 blocks


VIT_SIDE = 112
"""The ViT's image side in the CPU steps below: 49 patches where benchmarks/fidelity.py's 224 x 224 has 196 (its
amp-bf16 steps, emulated on an AVX2 CPU, cost a quarter); the prediction's mechanism does not depend on it."""


def _vit_at_side(timm_model: Callable[[Path, str, int, int], Path]) -> Callable[[Path, str, int, int], Path]:
    """fidelity_suite.timm_model with the ViT built for :data:`VIT_SIDE` x :data:`VIT_SIDE` (``model_args.img_size``, as a
    timm hub config sets it); other models as fidelity builds them."""

    def build(directory: Path, architecture: str, side: int, classes: int) -> Path:
        if not architecture.startswith("vit_"):
            return timm_model(directory, architecture, side, classes)
        folder = directory / architecture
        folder.mkdir(parents=True, exist_ok=True)
        config = {"architecture": architecture, "num_classes": classes, "model_args": {"img_size": VIT_SIDE},
                  "pretrained_cfg": {"input_size": [3, VIT_SIDE, VIT_SIDE], "num_classes": classes}}
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        return write_hf_model_file(find_hf_config(str(folder)), folder)

    return build


@pytest.mark.slow
@pytest.mark.full
def test_timm_models_train_on_the_cpu_as_predicted(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/fidelity.py's timm cases (a ViT single-process, with full and selective checkpointing and on 2
    FSDP2 gloo ranks, here at :data:`VIT_SIDE` x :data:`VIT_SIDE`; a ResNet in fp32 and amp-bf16): real steps' peak
    live bytes within 2 % of the prediction. The ``full`` tier only (``python -m pytest -m full``: 6 probes and two
    timm profiles, 70 s); the default run profiles timm's ViT above."""
    pytest.importorskip("timm")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fidelity
    import fidelity_suite

    monkeypatch.setattr(fidelity_suite, "timm_model", _vit_at_side(fidelity_suite.timm_model))
    wanted = {"timm-vit", "timm-resnet"}
    result = fidelity.run_suite("cpu", wanted=wanted)
    assert len(result.rows) == len(fidelity.select_cases("cpu", False, wanted)) >= 6
    assert all(row.ok for row in result.rows), [(r.label, r.skipped) for r in result.rows]
    off = {row.label: row.pred_bytes / row.meas_bytes - 1 for row in result.rows
           if abs(row.pred_bytes / row.meas_bytes - 1) > 0.02}
    assert not off, off
