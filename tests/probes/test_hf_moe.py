"""Mixture-of-Experts Hugging Face configs through --hf (planned from their shape: exact parameters, ep in the
search, the Megatron export), the one-line error for MoE families the formula does not know, and the error a model
file with a grouped-GEMM MoE layer gets instead of "make example_batch return ..."."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from optplan.tui.cli import app

transformers = pytest.importorskip("transformers")
runner = CliRunner()

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 4,
           "vocab_size": 1000, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 1024,
           "tie_word_embeddings": False}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "qk_nope_head_dim": 32, "vocab_size": 500, "max_position_embeddings": 1024,
            "tie_word_embeddings": False, "n_group": 1, "topk_group": 1}

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
             "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 48, "num_experts": 8, "num_experts_per_tok": 2,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 500, "max_position_embeddings": 1024,
             "tie_word_embeddings": False}


def _folder(tmp_path: Path, name: str, doc: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


def _hf_count(doc: dict) -> int:
    config = transformers.AutoConfig.for_model(**{k: v for k, v in doc.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("doc", [MIXTRAL, DEEPSEEK, QWEN3_MOE], ids=["mixtral", "deepseek_v3", "qwen3_moe"])
def test_moe_configs_profile_with_transformers_parameter_count(tmp_path: Path, doc: dict,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    r = runner.invoke(app, ["profile", "--hf", str(_folder(tmp_path, doc["model_type"], doc)), "--seq-len", "256",
                            "--json"])
    assert r.exit_code == 0, r.output
    prof = json.loads(r.output)
    assert prof["params"] == _hf_count(doc)
    assert prof["transformer"]["moe"]["experts"] == 8 and prof["model_class"] == doc["architectures"][0]
    assert any("Mixture-of-Experts model: profiled by formula" in n for n in prof["notes"])


def test_moe_plan_searches_ep_and_exports_megatron_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan"
    r = runner.invoke(app, ["recommend", "--hf", str(_folder(tmp_path, "mixtral", MIXTRAL)), "--gpu", "H100-SXM",
                            "--gpus", "16", "--seq-len", "1024", "--global-batch", "64", "--engine", "megatron",
                            "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output[r.output.index("{"):])
    assert rec["search"]["space_size"] > 0
    launch = (out / "launch.sh").read_text()
    assert "--num-experts 8" in launch and "--expert-model-parallel-size" in launch


def test_unknown_moe_family_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    qwen = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 100}
    r = runner.invoke(app, ["profile", "--hf", str(_folder(tmp_path, "qwen", qwen))])
    assert r.exit_code == 2 and "qwen2_moe is a Mixture-of-Experts model" in r.output and "--arch" in r.output
    assert "Traceback" not in r.output


def test_a_transformers_moe_model_file_profiles_by_the_tokens_routed(tmp_path: Path) -> None:
    """transformers' Mixtral in a model file (its experts: torch._grouped_mm, 16-bit only, routed by value) profiles:
    its experts are recognised and run the balanced dispatch (tests/probes/test_moe_model_files.py has the figures)."""
    path = tmp_path / "moe_file.py"
    path.write_text(
        "import torch, transformers\n"
        "def build_model():\n"
        "    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "        num_attention_heads=4, num_key_value_heads=2, vocab_size=100, num_local_experts=4,\n"
        "        num_experts_per_tok=2)\n"
        "    return transformers.MixtralForCausalLM(cfg)\n"
        "def example_batch(batch_size, seq_len):\n"
        "    ids = torch.randint(0, 100, (batch_size, seq_len))\n"
        "    return {'input_ids': ids, 'labels': ids}\n"
        "def loss_fn(output, batch):\n"
        "    return output.loss\n", encoding="utf-8")
    r = runner.invoke(app, ["profile", str(path), "--seq-len", "32"])
    assert r.exit_code == 0, r.output
    assert "balanced" in r.output and "2 of 4 experts" in r.output


UNRECOGNISED_MOE = """
import torch, torch.nn as nn

class Experts(nn.Module):  # 3-D expert weights beside a 2-D one: not the experts layout optplan reads
    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(4, 32, 64))
        self.w_out = nn.Parameter(torch.randn(4, 64, 32))
        self.mix = nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        x = x.reshape(-1, 32) @ self.mix
        offs = torch.tensor([x.shape[0] // 4 * (i + 1) for i in range(4)], dtype=torch.int32)
        h = torch._grouped_mm(x, self.w_in, offs=offs)
        return torch._grouped_mm(h, self.w_out, offs=offs)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.experts = Experts()

    def forward(self, tokens):
        return self.experts(self.emb(tokens))

def build_model():
    return Model()
"""


def test_a_grouped_gemm_moe_optplan_does_not_recognise_says_what_it_is(tmp_path: Path) -> None:
    path = tmp_path / "odd_moe.py"
    path.write_text(UNRECOGNISED_MOE, encoding="utf-8")
    r = runner.invoke(app, ["profile", str(path), "--seq-len", "32"])
    if r.exit_code == 0:
        pytest.skip(f"torch {torch.__version__} runs torch._grouped_mm in fp32 here")
    assert r.exit_code == 2, r.output
    assert "grouped-GEMM expert kernel" in r.output and "did not recognise its experts" in r.output
    assert "--arch" in r.output and "make example_batch" not in r.output


def test_moe_config_searches_megatron_ep_without_engine_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE config is profiled from its shape, so Megatron's expert parallelism is searched by default (a model file
    would limit the engines to DeepSpeed and torch): a Qwen3-30B-A3B-shaped config on one node of 8 H200s picks ep.
    (On 8 H100s every Megatron ep plan needs more than 78.4 GiB at the 90th percentile of the allocator margins, e.g.
    ep4 at 78.3 GiB at the median and 88.2 at the 90th, so a torch FSDP plan that fits at it ranks first.)"""
    monkeypatch.setenv("OPTPLAN_CACHE_DIR", str(tmp_path / "cache"))
    doc = {**QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960}
    r = runner.invoke(app, ["recommend", "--hf", str(_folder(tmp_path, "qwen3-30b", doc)), "--gpu", "H200",
                            "--gpus", "8", "--seq-len", "4096", "--global-batch", "512", "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output[r.output.index("{"):])
    plan = rec["plan"]["strategy"] if "strategy" in rec["plan"] else rec["plan"]
    assert plan["engine"] == "megatron" and plan["ep"] > 1, plan
