"""Mixture-of-Experts model files (issue 19): their MoE layers are found by structure and profiled with a balanced
dispatch (probes/moe_layers.py, moe_dispatch.py, moe_profile.py) — shapes read exactly, FLOPs by the tokens routed,
live bytes against a real CPU step that routes for real, and the layers optplan cannot read named."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from optplan.estimators.arch import arch_params, parse_arch, profile_from_arch
from optplan.estimators.moe import MoeShape
from optplan.probes.contract import load_contract
from optplan.probes.model_errors import ModelFileError
from optplan.probes.moe_layers import find_moe_layers, layer_pattern
from optplan.probes.static import find_repeated_block, profile_contract

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
transformers = pytest.importorskip("transformers")

HF_FILE = """
import transformers

def build_model():
    cfg = transformers.{config}({kwargs})
    return transformers.{model}(cfg)
"""
MIXTRAL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=1000, num_local_experts=8, num_experts_per_tok=2,
               tie_word_embeddings=False, max_position_embeddings=128)
DEEPSEEK_V3 = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                   n_routed_experts=16, num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
                   qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
                   tie_word_embeddings=False, max_position_embeddings=128)
QWEN3 = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=96, num_experts=8, num_experts_per_tok=2,
             decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=128)
QWEN2 = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
             shared_expert_intermediate_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=128)


def _hf_file(tmp_path: Path, name: str, config: str, model: str, kwargs: dict[str, object]) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(HF_FILE.format(config=config, model=model,
                                                   kwargs=", ".join(f"{k}={v!r}" for k, v in kwargs.items()))))
    return path


def _example(name: str):
    """examples/<name>.py as a module (registered: its dataclasses need their module)."""
    import importlib.util
    module_name = f"optplan_example_{name}_moe_tests"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def _profile(path: Path):
    return profile_contract(load_contract(path))


def _hand_fwd_flops(*, h: int, s: int, layers: int, moe_layers: int, proj: int, ffn_dense: int, moe_ffn: int,
                    topk: int, shared: int, experts: int, vocab: int, qk: float, v: float, heads: int) -> float:
    """Forward FLOPs of one sample by hand: projections 2·params, SwiGLU MLPs 2·3·h·F at the width a token computes
    through, the router 2·h·E, the attention core 2·s·heads·(qk + v) per token, the head 2·h·V."""
    per_token = (layers * (2 * proj + 2 * s * heads * (qk + v)) + (layers - moe_layers) * 2 * 3 * h * ffn_dense
                 + moe_layers * (2 * 3 * h * moe_ffn * (topk + shared) + 2 * h * experts) + 2 * h * vocab)
    return float(s * per_token)


def test_hf_mixtral_file_is_read_and_priced_by_the_tokens_routed(tmp_path: Path) -> None:
    prof = _profile(_hf_file(tmp_path, "mixtral", "MixtralConfig", "MixtralForCausalLM", MIXTRAL))
    shape = prof.transformer
    assert shape is not None and shape.gated
    assert shape.moe == MoeShape(experts=8, topk=2, moe_ffn=512)
    assert shape.ffn == 2 * 512  # the width a token computes through
    spec = parse_arch("layers=3,hidden=256,heads=8,kv_heads=2,ffn=512,vocab=1000,gated=1,tied=0,experts=8,topk=2,"
                      "seq=128")
    assert prof.params == arch_params(spec)[0]
    # by hand: q, k, v, o (2·256² + 2·256·64), two of eight experts, the router, the head; not all eight experts
    hand = _hand_fwd_flops(h=256, s=128, layers=3, moe_layers=3, proj=2 * 256 * 256 + 2 * 256 * 64, ffn_dense=0,
                           moe_ffn=512, topk=2, shared=0, experts=8, vocab=1000, qk=32, v=32, heads=8)
    assert prof.fwd_flops_per_sample == hand
    assert prof.fwd_flops_per_sample == pytest.approx(profile_from_arch(spec).fwd_flops_per_sample, rel=2e-3)
    assert prof.supports_checkpointing and prof.has_activation("bf16-weights")  # fp32 passes too: no grouped_mm
    assert any("balanced dispatch" in n for n in prof.notes)


def test_hf_deepseek_v3_file_keeps_its_dense_layer_shared_expert_and_latent_attention(tmp_path: Path) -> None:
    prof = _profile(_hf_file(tmp_path, "dsv3", "DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3))
    shape = prof.transformer
    assert shape is not None and shape.mla is not None and shape.kv_heads is None
    assert (shape.mla.kv_lora, shape.mla.q_lora, shape.mla.rope_dim, shape.mla.nope_dim) == (64, 96, 16, 32)
    assert shape.moe == MoeShape(experts=16, topk=4, moe_ffn=128, shared_experts=1, first_dense=1, dense_ffn=512)
    spec = parse_arch("layers=5,hidden=256,heads=4,ffn=512,vocab=1000,gated=1,tied=0,kv_lora=64,q_lora=96,rope_dim=16,"
                      "nope_dim=32,v_dim=32,experts=16,topk=4,moe_ffn=128,shared_experts=1,first_dense=1,seq=128")
    assert prof.params == arch_params(spec)[0]
    # the dense first layer is kept in both depth cuts (2 and 3 blocks), the MoE blocks extrapolated
    assert prof.profiled_blocks == 3
    assert prof.fwd_flops_per_sample == pytest.approx(profile_from_arch(spec).fwd_flops_per_sample, rel=2e-3)
    # full checkpointing with the generation cache on used to fail (the recompute wrote the latent cache twice)
    assert prof.supports_checkpointing


def test_qwen_moe_files_every_other_layer_and_a_gated_shared_expert(tmp_path: Path) -> None:
    qwen3 = _profile(_hf_file(tmp_path, "qwen3", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3)).transformer
    assert qwen3 is not None and qwen3.head_dim == 96
    assert qwen3.moe == MoeShape(experts=8, topk=2, moe_ffn=128, moe_every=2, dense_ffn=512)
    qwen2 = _profile(_hf_file(tmp_path, "qwen2", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", QWEN2)).transformer
    assert qwen2 is not None and qwen2.moe == MoeShape(experts=8, topk=2, moe_ffn=128, shared_experts=4)


def test_layer_pattern_is_the_estimators_rule() -> None:
    assert layer_pattern([0, 1, 2, 3], 4) == (0, 1)
    assert layer_pattern([1, 2, 3], 4) == (1, 1)
    assert layer_pattern([1, 3, 5], 6) == (0, 2)
    assert layer_pattern([3, 5, 7], 8) == (2, 2)
    assert layer_pattern([0, 3], 4) is None


TINY_MOE = f"""
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("optplan_example_moe", {str(EXAMPLES / "moe.py")!r})
moe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = moe
spec.loader.exec_module(moe)
CFG = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256, num_experts=8,
           num_experts_per_tok=2, moe_ffn_dim=32, n_shared_experts=1, first_dense=1, max_seq_len=64)
OPTPLAN = {{"seq_len": 32}}

def build_model():
    return moe.build_model("lite", **CFG)

def example_batch(batch_size, seq_len):
    return torch.randint(0, 256, (batch_size, seq_len))

loss_fn = moe.loss_fn
"""


def test_examples_moe_live_bytes_match_a_real_step_that_routes_for_real(tmp_path: Path) -> None:
    """The profile's balanced dispatch against a real CPU step of examples/moe.py, whose loop routes each token by
    the router's values: the same token copies go through the experts however they are spread. Activations within
    8 % (the real loop also keeps int64 routing indices per token copy, ~10 % of a 64-wide fp32 row and nothing at
    real widths), the step's peak within 3 %."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from test_cpu_accounting import compare
    finally:
        sys.path.pop(0)
    path = tmp_path / "tiny_moe.py"
    path.write_text(textwrap.dedent(TINY_MOE))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, profile, _ = compare(path)
    finally:
        torch.set_num_threads(before)
    assert profile.transformer is not None and profile.transformer.moe == MoeShape(
        experts=8, topk=2, moe_ffn=32, shared_experts=1, first_dense=1, dense_ffn=160)
    assert profile.repeated_block is not None and profile.repeated_block.class_name == "Block"  # not the experts
    for precision, ckpt, mbs, pred, real in rows:
        where = (precision, ckpt, mbs, real.phase)
        assert pred.act == pytest.approx(real.act, rel=0.08), where
        assert pred.total == pytest.approx(real.total, rel=0.03), where


def test_examples_moe_full_size_is_mixtral_8x7b_exactly() -> None:
    """examples/moe.py's "mixtral" size on the meta device: Mixtral 8x7B's 46,702,792,704 parameters, the same as
    --arch's count of that shape."""
    with torch.device("meta"):
        model = _example("moe").build_model("mixtral")
    assert sum(p.numel() for p in model.parameters()) == 46_702_792_704
    layers = find_moe_layers(model, [model.config], "moe.py")
    assert len(layers) == 32 and {(m.experts, m.topk, m.moe_ffn, m.fused) for m in layers} == {(8, 2, 14336, False)}
    block = find_repeated_block(model)
    assert block is not None and block.cls.__name__ == "Block" and len(block.blocks) == 32


BAD = """
import torch
import torch.nn as nn

class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

class Layer(nn.Module):
    def __init__(self, top_k, router, index):
        super().__init__()
        experts = 4 if index == 0 else {second}
        {topk_line}
        if router:
            self.router = nn.Linear(32, experts, bias=False)
        self.experts = nn.ModuleList([Expert() for _ in range(experts)])

    def forward(self, x):
        return x + sum(e(x) for e in self.experts)

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.layers = nn.ModuleList([Layer({top_k}, {router}, i) for i in range(3)])

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return h

def build_model():
    return Model()
"""


@pytest.mark.parametrize(("top_k", "router", "second", "message"), [
    (2, False, 4, "holds 4 experts .* but no router"),
    (6, True, 4, "routes each token to 6 experts but holds 4"),
    (None, True, 4, "does not say how many experts each token goes to"),
    (2, True, 8, "Mixture-of-Experts layers differ"),
])
def test_moe_layers_optplan_cannot_read_are_named(tmp_path: Path, top_k: int | None, router: bool, second: int,
                                                   message: str) -> None:
    path = tmp_path / "bad_moe.py"
    topk_line = f"self.top_k = {top_k}" if top_k is not None else "pass"
    path.write_text(textwrap.dedent(BAD).format(top_k=top_k, router=router, second=second, topk_line=topk_line))
    with pytest.raises(ModelFileError, match=message) as err:
        _profile(path)
    assert "\n" not in str(err.value) and " — " in str(err.value)  # one line: the problem, then the fix


def test_a_stack_of_mlp_blocks_is_not_taken_for_experts() -> None:
    with torch.device("meta"):
        model = _example("mlp").build_model()
    assert find_moe_layers(model, [], "mlp.py") == []


def test_lora_adapters_on_list_experts_still_read_as_experts(tmp_path: Path) -> None:
    """LoRA (--finetune lora) wraps every expert's Linear layers: the adapters are not expert matrices, so the experts
    are still found and profiled by the balanced dispatch (not by the real-run fallback). Four experts a layer (the
    tiny model's eight halved): the adapted Linear layers of each expert are what the profile steps through."""
    from optplan.estimators.finetune import LoraRequest

    path = tmp_path / "tiny_moe.py"
    assert TINY_MOE.count("num_experts=8,") == 1
    path.write_text(textwrap.dedent(TINY_MOE.replace("num_experts=8,", "num_experts=4,")))
    prof = profile_contract(load_contract(path), lora=LoraRequest(rank=4))
    assert prof.adapter is not None and prof.transformer is not None
    assert prof.transformer.moe == MoeShape(experts=4, topk=2, moe_ffn=32, shared_experts=1, first_dense=1,
                                            dense_ffn=160)
    assert any("balanced dispatch" in n for n in prof.notes)
    assert not any("real CPU run" in n for n in prof.notes)


TORCHTITAN_STYLE = """
import torch, torch.nn as nn, torch.nn.functional as F

H, FF, E, K, V, L = 64, 32, 8, 2, 128, 3

class GroupedExperts(nn.Module):  # torchtitan's layout: w1, w3 [E, dim, hidden], w2 [E, hidden, dim]
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, H, FF) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, FF, H) * 0.02)
        self.w3 = nn.Parameter(torch.randn(E, H, FF) * 0.02)

    def forward(self, x, counts):
        outs = []
        for e, chunk in enumerate(torch.split(x, counts.tolist())):  # data-dependent split
            outs.append((F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs)

class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.top_k = K

    def forward(self, x):
        scores = self.gate(x).softmax(-1)
        return scores.topk(self.top_k, dim=-1)

class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = GroupedExperts()

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, idx = self.router(x)
        order = idx.reshape(-1).argsort()
        counts = torch.bincount(idx.reshape(-1), minlength=E)
        y = self.experts(x.repeat_interleave(K, 0)[order], counts)
        out = torch.empty_like(y)
        out[order] = y
        return (out.view(-1, K, H) * w.unsqueeze(-1)).sum(1).view(shape)

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.attn = nn.MultiheadAttention(H, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(H)
        self.moe = MoE()

    def forward(self, x):
        y = self.norm(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.moe(self.norm2(x))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.out = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

OPTPLAN = {"seq_len": 32}

def build_model():
    return Model()
"""


def test_torchtitan_style_grouped_experts_run_the_balanced_dispatch(tmp_path: Path) -> None:
    """3-D experts of torchtitan's layout ([E, dim, hidden]) behind a router module, routed by a data-dependent
    split: the layer is replaced whole (router weight, balanced batched matmuls); the experts' FLOPs are those of
    top-2 of 8, by hand."""
    path = tmp_path / "titan_moe.py"
    path.write_text(TORCHTITAN_STYLE)
    prof = _profile(path)
    assert not any("real CPU run" in n for n in prof.notes)
    assert any("balanced dispatch" in n and "3-D weights" in n for n in prof.notes)
    # per token and layer, forward: the router 2·64·8, two of eight SwiGLU experts 2·3·64·32 each
    base = _profile_without_moe_flops(tmp_path)
    assert prof.fwd_flops_per_sample - base == 32 * 3 * (2 * 64 * 8 + 2 * 2 * 3 * 64 * 32)


def _profile_without_moe_flops(tmp_path: Path) -> float:
    """The same model with identity MoE layers: its forward FLOPs per sample."""
    path = tmp_path / "titan_dense.py"
    path.write_text(TORCHTITAN_STYLE.replace("return x + self.moe(self.norm2(x))", "return x + self.norm2(x)")
                    .replace("self.moe = MoE()", "self.moe = None"))
    return _profile(path).fwd_flops_per_sample
