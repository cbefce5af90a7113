"""The key heads a model's attention call receives (probes/attention_heads.py), and what torch's ring attention makes
of them (estimators/ring_attention.py, checked against torch's own ring by benchmarks/fidelity_ring_attention_cpu.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import small_llama_source
from factories import load_benchmark

from optplan.estimators.compute import transformer_dims
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.strategy import Strategy
from optplan.probes.attention_heads import attention_calls
from optplan.probes.contract import load_contract
from optplan.probes.static import profile_contract

SMALL_LLAMA = small_llama_source(n_heads=8)
GQA_FORWARD = """
    import torch.nn.functional as F


    def gqa_forward(self, x, cos, sin):
        '''examples/llama.py's attention handing its 2 key/value heads to SDPA as they are (enable_gqa).'''
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    llama.Attention.forward = gqa_forward
    """


def test_the_recorder_sees_the_heads_a_call_receives() -> None:
    q = torch.randn(1, 8, 16, 4)
    kv = torch.randn(1, 2, 16, 4)
    with attention_calls() as repeated:
        F.scaled_dot_product_attention(q, kv.repeat_interleave(4, 1), kv.repeat_interleave(4, 1), is_causal=True)
    with attention_calls() as grouped:
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    with attention_calls() as none:
        torch.matmul(q, q.transpose(-1, -2))
    assert (repeated.calls, repeated.query_heads, repeated.key_heads) == (1, 8, 8)
    assert (grouped.calls, grouped.query_heads, grouped.key_heads) == (1, 8, 2)
    assert (none.calls, none.key_heads) == (0, 0)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("attention_heads")
    out = {}
    for name, source in (("repeated", SMALL_LLAMA), ("grouped", SMALL_LLAMA + textwrap.dedent(GQA_FORWARD))):
        path = folder / f"{name}.py"
        path.write_text(source)
        out[name] = profile_contract(load_contract(path))
    return out


def test_a_profile_records_whether_the_model_repeats_its_kv_heads(profiles) -> None:
    repeated, grouped = profiles["repeated"], profiles["grouped"]
    assert repeated.transformer is not None and repeated.transformer.kv_heads == 2
    assert repeated.attention_key_heads == 8  # examples/llama.py repeats its 2 K/V heads before SDPA
    assert grouped.attention_key_heads == 2
    assert transformer_dims(repeated).attention_key_heads == 8
    assert transformer_dims(grouped).attention_key_heads == 2


def test_torch_context_parallelism_prices_the_kv_the_ring_moves(profiles) -> None:
    """Across nodes, torch's ring moves and accumulates the K/V the call receives: repeated heads cost more ring
    time and more memory-bound bytes than the same model passing its 2 key/value heads; Megatron-Core's ring is
    unaffected (it is its own model)."""
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=4, gpus_per_node=1, inter_node_bandwidth_bytes_per_s=25e9)
    torch_cp = Strategy(engine="torch", precision="bf16", cp=4, mbs=2048)  # 16k tokens a rank: bandwidth-bound
    est_rep, est_gqa = (estimate(profiles[n], cluster, torch_cp) for n in ("repeated", "grouped"))
    rep, gqa = est_rep.time, est_gqa.time
    assert 3.5 < rep.cp_comm_s / gqa.cp_comm_s <= 4.0  # 8 heads' K/V and dK/dV against 2 (and the same latencies)
    # the estimate says what the ring is priced as and where its K/V width comes from
    assert any("torch's ring attention" in n and "the 8 key/value heads the model's attention call receives "
               "(measured: it repeats its K/V heads first)" in n for n in est_rep.notes), est_rep.notes
    assert any("the 2 key/value heads the model's attention call receives (measured)" in n for n in est_gqa.notes)
    assert rep.memory_bound_s > gqa.memory_bound_s
    assert rep.step_s > gqa.step_s
    megatron = Strategy(engine="megatron", precision="bf16", cp=4, mbs=2048)
    m_rep, m_gqa = (estimate(profiles[n], cluster, megatron) for n in ("repeated", "grouped"))
    assert m_rep.time.cp_comm_s == pytest.approx(m_gqa.time.cp_comm_s)
    assert not any("torch's ring attention" in n for n in m_rep.notes)


def test_the_ring_bytes_are_torchs_own(tmp_path: Path) -> None:
    """torch's ring attention run on 4 gloo ranks, its memory-bound bytes counted: the estimate's are the heaviest
    rank's, for K/V passed as they are (the first rank's backward is the heaviest) and repeated (the last's)."""
    rows = load_benchmark("fidelity_ring_attention_cpu.py").run(tmp_path, cp_degrees=(4,))
    assert {r.key_heads for r in rows} == {2, 8}
    for r in rows:
        assert r.pred_fwd == pytest.approx(r.real_fwd, rel=1e-3), r
        assert r.pred_bwd == pytest.approx(r.real_bwd, rel=1e-3), r
