"""Tensor parallelism by a model's own plan (a Hugging Face tp_plan) on the torch engine: what each rank holds,
what the head costs, and which strategies are refused."""

from __future__ import annotations

import pytest

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.errors import OptplanError
from optplan.estimators.estimate import estimate
from optplan.estimators.hardware import Cluster, find_gpu
from optplan.estimators.memory import memory_breakdown, stage_params
from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy
from optplan.estimators.tensor_plan import TensorPlan, params_per_tp_rank
from optplan.estimators.validity import check_strategy

ARCH = "layers=8,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,seq=2048,gated=1"
LLAMA_PLAN = {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
              "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}


def _profiles() -> tuple[ModelProfile, ModelProfile]:
    base = profile_from_arch(parse_arch(ARCH))
    norms = (2 * 8 + 1) * 1024  # two RMSNorms per layer and the final one stay whole on every rank
    plan = TensorPlan(styles=LLAMA_PLAN, sharded_params=base.params - norms, gathers_logits=True,
                      source="test")
    return base, base.model_copy(update={"tensor_plan": plan})


def test_params_per_rank_split_only_what_the_plan_splits() -> None:
    base, planned = _profiles()
    s = Strategy(engine="torch", precision="bf16", tp=4, dp=1)
    norms = (2 * 8 + 1) * 1024
    assert stage_params(planned, s) == pytest.approx((base.params - norms) / 4 + norms)
    assert params_per_tp_rank(planned.params, planned.tensor_plan, 1) == planned.params  # type: ignore[arg-type]
    # Megatron's layout (and a torch model without a plan) keeps the formula it had: blocks, embedding and
    # head over tp, the rest (the final norm here) whole; its per-block norms are split too
    megatron = (base.params - 1024) / 4 + 1024
    assert stage_params(base, s) == pytest.approx(megatron)
    assert stage_params(planned, s.model_copy(update={"engine": "megatron", "sp": False})) == \
        pytest.approx(megatron)


def test_torch_engine_defaults_to_no_sequence_parallelism() -> None:
    assert Strategy(engine="torch", tp=2).sp is False
    assert Strategy(engine="megatron", tp=2).sp is True
    assert Strategy(tp=2).sp is True  # deepspeed (Megatron-DeepSpeed) keeps Megatron's default


def test_gathered_logits_stay_whole_on_every_rank() -> None:
    """The head's output gathered to every rank: the logits and the loss are not divided by tp (Megatron keeps
    1/tp of them), so the activations grow by (1 - 1/tp) of the profile's ends."""
    base, planned = _profiles()
    s = Strategy(engine="torch", precision="bf16", tp=4, dp=1, mbs=1, fsdp="none")
    cap = 10**15
    gathered = memory_breakdown(planned, s, cap).activations_bytes
    sliced = memory_breakdown(planned.model_copy(update={"tensor_plan": planned.tensor_plan.model_copy(  # type: ignore[union-attr]
        update={"gathers_logits": False})}), s, cap).activations_bytes
    # the profile's ends: at least the bf16 logits of one sample (seq x vocab x 2 bytes)
    assert gathered - sliced >= 0.75 * 2048 * 32000 * 2 * 0.99
    assert gathered > sliced


def test_gathered_logits_cost_an_all_gather() -> None:
    _, planned = _profiles()
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    s = Strategy(engine="torch", precision="bf16", tp=4, dp=2, fsdp="full", mbs=1)
    sliced = planned.model_copy(update={"tensor_plan": planned.tensor_plan.model_copy(  # type: ignore[union-attr]
        update={"gathers_logits": False})})
    t_gathered = estimate(planned, cluster, s).time
    t_sliced = estimate(sliced, cluster, s).time
    # one all-gather of seq x vocab bf16 logits over NVLink: above the sliced plan's 3 tiny CE all-reduces
    assert t_gathered.tp_comm_s > t_sliced.tp_comm_s
    assert t_gathered.step_s > t_sliced.step_s


def test_sequence_parallel_refused_where_the_plan_has_none() -> None:
    _, planned = _profiles()
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=8, gpus_per_node=8)
    with pytest.raises(OptplanError, match="--no-sp"):
        check_strategy(planned, cluster, Strategy(engine="torch", fsdp="full", tp=2, dp=4, sp=True))
    check_strategy(planned, cluster, Strategy(engine="torch", fsdp="full", tp=2, dp=4))
    with_sp = planned.model_copy(update={"tensor_plan": planned.tensor_plan.model_copy(  # type: ignore[union-attr]
        update={"styles": {**LLAMA_PLAN, "model.norm": "sequence_parallel"}})})
    check_strategy(with_sp, cluster, Strategy(engine="torch", fsdp="full", tp=2, dp=4, sp=True))


def test_a_vocab_parallel_embedding_keeps_a_whole_gradient_without_fsdp() -> None:
    """DTensor gives the vocab-split embedding a replicated gradient (measured, benchmarks/fidelity_tp_cpu.py):
    (1 - 1/tp) of V x h more gradient bytes per rank, unless FSDP reduce-scatters it."""
    from optplan.estimators.memory import model_states

    _, planned = _profiles()
    with_grad = planned.model_copy(update={"tensor_plan": planned.tensor_plan.model_copy(  # type: ignore[union-attr]
        update={"replicated_grad_params": 32000 * 1024})})
    s = Strategy(engine="torch", precision="fp32", tp=4, dp=1)
    extra = model_states(with_grad, s).grads_bytes - model_states(planned, s).grads_bytes
    assert extra == round(32000 * 1024 * (1 - 1 / 4) * 4)
    fsdp = Strategy(engine="torch", precision="fp32", tp=4, dp=2, fsdp="full")
    assert model_states(with_grad, fsdp).grads_bytes == model_states(planned, fsdp).grads_bytes
