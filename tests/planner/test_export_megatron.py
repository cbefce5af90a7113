"""Megatron-LM pretrain_gpt.py arguments: golden files, Megatron's own rules, and refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optplan.estimators.buckets import DeepSpeedBuckets
from optplan.estimators.pipeline_layout import stage_layers
from optplan.estimators.profile import TransformerShape
from optplan.estimators.strategy import Strategy
from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.megatron import (
    megatron_args,
    megatron_env,
    megatron_notes,
    parse_megatron_args,
    validate_megatron_args,
)
from optplan.planner.export.megatron_layout import megatron_layout, parse_megatron_layout
from optplan.planner.validate import ExportValidationError

GOLDEN = Path(__file__).parent / "golden" / "megatron"
BUCKETS = DeepSpeedBuckets(reduce_bucket_size=16_777_216, allgather_bucket_size=16_777_216,
                           stage3_prefetch_bucket_size=15_099_494, stage3_param_persistence_threshold=40_960,
                           stage3_max_live_parameters=1_000_000_000)
LLAMA_70B = TransformerShape(hidden=8192, layers=80, heads=64, kv_heads=8, vocab=128256, ffn=28672, gated=True)
GPT2_XL = TransformerShape(hidden=1600, layers=48, heads=25, vocab=50257, max_seq_len=1024)


def make_plan(shape: TransformerShape | None = LLAMA_70B, *, seq_len: int | None = 4096, model: str = "llama-70b",
              gpus_per_node: int = 8, **strategy) -> ExportPlan:
    fields = dict(engine="megatron", tp=8, pp=4, vpp=2, dp=4, mbs=1, grad_accum=16)
    fields.update(strategy)
    return ExportPlan(strategy=Strategy(**fields), model=model, model_path="", block_class=None,
                      params=70_553_706_496, transformer=shape, seq_len=seq_len, buckets=BUCKETS, gpu="H100-SXM",
                      gpus_per_node=gpus_per_node)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("OPTPLAN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"missing golden file {path}: run the tests with OPTPLAN_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden file (OPTPLAN_UPDATE_GOLDEN=1)"


GOLDEN_CASES = {
    "llama70b_tp8_pp4_vpp2_dp4.args": lambda: make_plan(),
    "llama70b_tp8_pp2_cp2_zero1_fp8_selective.args": lambda: make_plan(
        pp=2, vpp=1, cp=2, dp=4, zero=1, precision="fp8", checkpointing="selective", grad_accum=8, seq_len=32768),
    "llama78_tp8_pp4_vpp2_layout.args": lambda: make_plan(LLAMA_70B.model_copy(update={"layers": 78})),
    "gpt2xl_tp1_dp8_fp16_full_sgd.args": lambda: make_plan(
        GPT2_XL, seq_len=1024, model="gpt2-xl", tp=1, pp=1, vpp=1, dp=8, precision="fp16", checkpointing="full",
        optimizer="sgd", flash=False, mbs=4, grad_accum=2),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_and_valid(name):
    plan = GOLDEN_CASES[name]()
    argv = megatron_args(plan)
    check_golden(name, "\n".join(argv) + "\n")
    validate_megatron_args(argv, plan)


def test_llama_70b_arguments():
    ns = parse_megatron_args(megatron_args(make_plan()))
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size) == (8, 4, 1)
    assert ns.num_layers_per_virtual_pipeline_stage == 10  # 80 layers / (pp 4 x vpp 2)
    assert ns.sequence_parallel and not ns.use_distributed_optimizer
    assert (ns.micro_batch_size, ns.global_batch_size) == (1, 64)  # 1 x 16 accumulation x dp 4
    assert (ns.seq_length, ns.max_position_embeddings) == (4096, 4096)
    assert (ns.num_layers, ns.hidden_size, ns.ffn_hidden_size, ns.num_attention_heads) == (80, 8192, 28672, 64)
    assert ns.group_query_attention and ns.num_query_groups == 8
    assert ns.swiglu and ns.normalization == "RMSNorm" and ns.position_embedding_type == "rope"
    assert ns.untie_embeddings_and_output_weights and not ns.add_bias_linear
    assert ns.bf16 and not ns.fp16 and ns.fp8 is None
    assert ns.recompute_granularity is None and ns.attention_backend == "fused"  # cuDNN: what H100 Megatron is priced at
    a100 = parse_megatron_args(megatron_args(make_plan().model_copy(update={"gpu": "A100-80GB"})))
    assert a100.attention_backend == "flash"  # the A100's fitted fractions: runs with FlashAttention
    assert (ns.optimizer, ns.adam_beta2, ns.lr, ns.clip_grad) == ("adam", 0.95, 3e-4, 1.0)


def test_gpt_style_model_keeps_megatron_defaults():
    plan = GOLDEN_CASES["gpt2xl_tp1_dp8_fp16_full_sgd.args"]()
    argv = megatron_args(plan)
    for flag in ("--swiglu", "--group-query-attention", "--sequence-parallel", "--untie-embeddings-and-output-weights",
                 "--num-layers-per-virtual-pipeline-stage", "--bf16"):
        assert flag not in argv
    ns = parse_megatron_args(argv)
    assert ns.fp16 and ns.ffn_hidden_size == 6400 and ns.attention_backend == "unfused"
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "uniform", 1)
    assert (ns.optimizer, ns.sgd_momentum, ns.weight_decay) == ("sgd", 0.9, 0.0)
    assert megatron_env(plan) == {}


def test_fp8_context_parallel_selective():
    plan = GOLDEN_CASES["llama70b_tp8_pp2_cp2_zero1_fp8_selective.args"]()
    ns = parse_megatron_args(megatron_args(plan))
    assert ns.bf16 and ns.fp8 == "hybrid" and ns.context_parallel_size == 2 and ns.use_distributed_optimizer
    assert ns.recompute_granularity == "selective" and ns.recompute_method is None
    assert megatron_env(plan) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_fp32_has_no_precision_flag_and_mha_no_gqa():
    shape = LLAMA_70B.model_copy(update={"kv_heads": None})
    argv = megatron_args(make_plan(shape, precision="fp32"))
    assert not {"--bf16", "--fp16", "--fp8-format", "--group-query-attention"} & set(argv)


def test_notes_explain_tokenizer_and_data():
    notes = " ".join(megatron_notes(make_plan()))
    assert "--tokenizer-type HuggingFaceTokenizer" in notes and "--vocab-size 128256" in notes
    assert "--data-path" in notes and "--train-iters" in notes


def test_the_models_rotary_base_and_norm_epsilon_reach_megatron():
    """Megatron builds the model from flags: a model stating rope_theta 1e6 (Mixtral) and norm_eps 1e-6 gets
    --rotary-base 1000000 --norm-epsilon 1e-06, not Megatron's 10000 and 1e-5; unstated ones are named in a note."""
    stated = LLAMA_70B.model_copy(update={"rope_theta": 1e6, "norm_eps": 1e-6})
    plan = make_plan(stated)
    argv = megatron_args(plan)
    ns = parse_megatron_args(argv)
    assert (ns.rotary_base, ns.norm_epsilon) == (1_000_000, 1e-6)
    validate_megatron_args(argv, plan)
    edited = [("10000" if a == "1000000" else a) for a in argv]
    with pytest.raises(ExportValidationError, match="--rotary-base is 10000 in the arguments but the plan needs "
                                                    "1000000"):
        validate_megatron_args(edited, plan)
    assert not any("does not state" in n for n in megatron_notes(plan))
    unstated = " ".join(megatron_notes(make_plan()))
    assert "does not state its rotary base (Megatron then uses 10000" in unstated and "normalisation epsilon" in unstated
    gpt = " ".join(megatron_notes(make_plan(GPT2_XL, seq_len=1024, tp=1, pp=1, vpp=1, dp=8)))
    assert "rotary" not in gpt  # learned positions: no rotary base to state
    odd = megatron_notes(make_plan(stated.model_copy(update={"rope_theta": 5e5 + 0.5})))
    assert any("passed as 500000" in n or "passed as 500001" in n for n in odd)


def test_virtual_stages_per_rank_is_accepted():
    plan = make_plan()
    argv = megatron_args(plan)
    i = argv.index("--num-layers-per-virtual-pipeline-stage")
    argv[i:i + 2] = ["--num-virtual-stages-per-pipeline-rank", "2"]
    validate_megatron_args(argv, plan)


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("plan, match", [
    (lambda: make_plan(engine="deepspeed", tp=1, pp=1, vpp=1, dp=8), "--engine megatron"),
    (lambda: make_plan(None), "transformer"),
    (lambda: make_plan(seq_len=None), "--seq-len"),
    (lambda: make_plan(precision="amp-bf16"), "autocast"),
    (lambda: make_plan(precision="bf16-pure"), "fp32 main parameters"),
    (lambda: make_plan(optimizer="adafactor"), "no adafactor optimizer"),
    (lambda: make_plan(optimizer="adamw8bit"), "no adamw8bit optimizer"),
    (lambda: make_plan(LLAMA_70B.model_copy(update={"heads": 60, "hidden": 7680})), "num_attention_heads"),
    (lambda: make_plan(LLAMA_70B.model_copy(update={"kv_heads": 4})), "num_query_groups"),
    (lambda: make_plan(seq_len=4095, pp=2, vpp=1, cp=2, dp=8), "2 \\* context-parallel-size"),
])
def test_unexportable(plan, match):
    with pytest.raises(NotExportable, match=match):
        megatron_args(plan())


def test_seq_len_falls_back_to_model_maximum():
    argv = megatron_args(make_plan(LLAMA_70B.model_copy(update={"max_seq_len": 8192}), seq_len=None))
    assert replaced(argv, "--seq-length", "8192") == argv


# --------------------------------------------------------------------------------------------------
# Validation against Megatron's rules and the plan
# --------------------------------------------------------------------------------------------------


def replaced(argv: list[str], flag: str, value: str | None) -> list[str]:
    out = list(argv)
    i = out.index(flag)
    if value is None:
        del out[i:i + 2]
    else:
        out[i + 1] = value
    return out


@pytest.mark.parametrize("flag, value, match", [
    ("--num-attention-heads", "4", "num_attention_heads \\(4\\) must be a multiple"),
    ("--num-query-groups", "4", "num_query_groups \\(4\\) must be a multiple"),
    ("--num-layers", "78", "78 layers over pp 4 do not split"),
    ("--num-layers-per-virtual-pipeline-stage", "7", "virtual stages of 7"),
    ("--global-batch-size", "66", "not divisible by micro-batch 1 x dp 4"),
    ("--tensor-model-parallel-size", "3", "not divisible by tp·pp·cp"),
    ("--ffn-hidden-size", "28673", "FFN width"),
    ("--max-position-embeddings", "2048", "max_position_embeddings"),
    ("--hidden-size", "8100", "not divisible by 64 heads"),
    ("--num-layers", None, "requires --num-layers"),
    ("--micro-batch-size", "x", "invalid int"),
    ("--lr", "0.001", "--lr is 0.001 in the arguments but the plan needs 0.0003"),
    ("--global-batch-size", "128", "--global-batch-size is 128"),
    ("--optimizer", "muon", "--optimizer is 'muon'"),
    ("--attention-backend", "fastest", "invalid choice"),
])
def test_validate_rejects(flag, value, match):
    plan = make_plan()
    with pytest.raises(ExportValidationError, match=match):
        validate_megatron_args(replaced(megatron_args(plan), flag, value), plan)


def test_validate_rule_checks_cover_cp_and_sp():
    cp_plan = make_plan(pp=2, vpp=1, cp=2, dp=8)
    argv = replaced(megatron_args(cp_plan), "--seq-length", "4094")
    with pytest.raises(ExportValidationError, match="2 \\* context-parallel-size"):
        validate_megatron_args(argv, cp_plan)
    pp_only = make_plan(vpp=1)
    with pytest.raises(ExportValidationError, match="78 layers are not divisible by --pp 4"):
        validate_megatron_args(replaced(megatron_args(pp_only), "--num-layers", "78"), pp_only)
    interleaved = make_plan()
    with pytest.raises(ExportValidationError, match="micro-batches per step \\(3\\) divisible by pp 4"):
        validate_megatron_args(replaced(megatron_args(interleaved), "--global-batch-size", "12"), interleaved)
    tp1 = make_plan(tp=1, pp=1, vpp=1, dp=8)
    with pytest.raises(ExportValidationError, match="sequence parallelism needs tensor parallelism"):
        validate_megatron_args(megatron_args(tp1) + ["--sequence-parallel"], tp1)


@pytest.mark.parametrize("extra, match", [
    (["--fp16"], "exclusive"),
    (["--recompute-method", "uniform", "--recompute-granularity", "selective"], "no --recompute-method"),
    (["--num-virtual-stages-per-pipeline-rank", "2"], "only one of"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--use-distributed-optimizer"], "--use-distributed-optimizer is True"),
])
def test_validate_rejects_extra_flags(extra, match):
    plan = make_plan()
    with pytest.raises(ExportValidationError, match=match):
        validate_megatron_args(megatron_args(plan) + extra, plan)


def test_validate_against_a_different_plan():
    argv = megatron_args(make_plan())
    with pytest.raises(ExportValidationError, match="plan needs"):
        validate_megatron_args(argv, make_plan(grad_accum=32))  # global batch 128, not 64
    with pytest.raises(ExportValidationError, match="micro-batch 1 x dp 3"):
        validate_megatron_args(argv, make_plan(pp=2, vpp=1, dp=6))  # world 96


def test_validate_for_unexportable_plan():
    plan = make_plan()
    other = make_plan(precision="amp-bf16")
    with pytest.raises(ExportValidationError, match="no Megatron-LM export"):
        validate_megatron_args(megatron_args(plan), other)


def test_validate_needs_a_list_of_strings():
    with pytest.raises(ExportValidationError, match="list of strings"):
        validate_megatron_args("--num-layers 80", make_plan())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Uneven splits: Megatron's custom pipeline layout
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, pp, vpp", [(78, 4, 1), (84, 4, 2), (61, 8, 4), (94, 8, 4), (61, 16, 1)])
def test_uneven_split_exports_a_layout_megatron_accepts(layers, pp, vpp):
    """A split pp (x vpp) does not divide is written as --pipeline-model-parallel-layout (not a refusal), with the
    layers the estimate priced, and passes the validator's parse of Megatron's grammar."""
    shape = LLAMA_70B.model_copy(update={"layers": layers})
    plan = make_plan(shape, pp=pp, vpp=vpp, tp=8 if pp <= 8 else 4, dp=4 if pp <= 8 else 2)
    argv = megatron_args(plan)
    assert "--num-layers-per-virtual-pipeline-stage" not in argv
    layout = argv[argv.index("--pipeline-model-parallel-layout") + 1]
    stages = parse_megatron_layout(layout)
    assert len(stages) == pp * vpp
    assert "".join(stages).count("t") == layers
    assert tuple(stage.count("t") for stage in stages) == stage_layers(layers, pp, vpp)
    # the busiest rank holds ceil(layers / pp): what timing and memory price
    per_rank = [sum(stages[k].count("t") for k in range(j, pp * vpp, pp)) for j in range(pp)]
    assert max(per_rank) == -(-layers // pp)
    validate_megatron_args(argv, plan)


def test_even_split_keeps_the_plain_flags():
    argv = megatron_args(make_plan())
    assert "--pipeline-model-parallel-layout" not in argv
    assert argv[argv.index("--num-layers-per-virtual-pipeline-stage") + 1] == "10"


@pytest.mark.parametrize("edit, match", [
    (lambda lay: lay.replace("E", "", 1), "start with the embedding E"),
    (lambda lay: lay + "t", "the loss L|decoder layers"),
    (lambda lay: lay.replace("|", "", 1), "not a multiple of --pipeline-model-parallel-size"),
    (lambda lay: lay.replace("t", "x", 1), "invalid layer character 'x'"),
    (lambda lay: lay.replace("L", "mL"), "MTP layers"),
])
def test_validate_rejects_bad_layouts(edit, match):
    plan = make_plan(LLAMA_70B.model_copy(update={"layers": 78}))
    argv = megatron_args(plan)
    i = argv.index("--pipeline-model-parallel-layout") + 1
    argv[i] = edit(argv[i])
    with pytest.raises(ExportValidationError, match=match):
        validate_megatron_args(argv, plan)


def test_validate_rejects_a_layout_other_than_the_priced_one():
    plan = make_plan(LLAMA_70B.model_copy(update={"layers": 78}), vpp=1)
    argv = megatron_args(plan)
    i = argv.index("--pipeline-model-parallel-layout") + 1
    argv[i] = "E" + "t" * 21 + "|" + "t" * 19 + "|" + "t" * 19 + "|" + "t" * 19 + "L"  # 78, but not balanced
    with pytest.raises(ExportValidationError, match="not the one the plan priced"):
        validate_megatron_args(argv, plan)
    argv_flags = megatron_args(plan) + ["--num-virtual-stages-per-pipeline-rank", "1"]
    with pytest.raises(ExportValidationError, match="only one of"):
        validate_megatron_args(argv_flags, plan)


def test_layout_string_round_trips_megatron_examples():
    """Megatron's own examples (pipeline_parallel_layer_layout.py docstrings, the model zoo's DeepSeek-V3 layout)
    unroll as Megatron unrolls them."""
    assert parse_megatron_layout("Ettt|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert parse_megatron_layout("E|(t|)*3,m|m||L") == ["E", "t", "t", "t", "m", "m", "", "L"]
    assert parse_megatron_layout("Et|(tt|)*30mL") == ["Et"] + ["tt"] * 30 + ["mL"]
    assert megatron_layout(61, 8, 4) == "Et|(tt|)*29t|tL"
    assert megatron_layout(6, 2, 1) == "Et*3|t*3L"
    assert parse_megatron_layout(megatron_layout(78, 4, 2)) == ["E" + "t" * 9] + ["t" * 10] * 6 + ["t" * 9 + "L"]


# --------------------------------------------------------------------------------------------------
# Expert-parallel all-to-all overlap
# --------------------------------------------------------------------------------------------------

MOE_SHAPE = TransformerShape.model_validate({**LLAMA_70B.model_dump(), "layers": 94, "hidden": 4096, "heads": 64,
                                             "kv_heads": 4, "ffn": 12288,
                                             "moe": {"experts": 128, "topk": 8, "moe_ffn": 1536}})


def test_ep_overlap_exports_megatrons_pair_and_its_environment():
    plan = make_plan(MOE_SHAPE, tp=2, pp=8, vpp=4, dp=16, ep=16, ep_overlap=True, checkpointing="selective",
                     grad_accum=16)
    argv = megatron_args(plan)
    assert "--overlap-moe-expert-parallel-comm" in argv and "--delay-wgrad-compute" in argv
    assert "--pipeline-model-parallel-layout" in argv  # 94 layers on pp 8 x vpp 4
    validate_megatron_args(argv, plan)
    assert megatron_env(plan) == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    plain = make_plan(MOE_SHAPE, tp=2, pp=8, vpp=4, dp=16, ep=16, grad_accum=16)
    assert "--overlap-moe-expert-parallel-comm" not in megatron_args(plain)
    assert megatron_env(plain) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@pytest.mark.parametrize("edit, match", [
    (lambda a: [x for x in a if x != "--overlap-moe-expert-parallel-comm"], "must be enabled when enabling delay"),
    (lambda a: a + ["--recompute-granularity", "full"], "disable full recomputation"),
    (lambda a: [x for x in a if x != "--bf16"], "bf16 or fp16"),
])
def test_validate_applies_megatrons_overlap_rules(edit, match):
    plan = make_plan(MOE_SHAPE, tp=2, pp=1, vpp=1, dp=32, ep=16, ep_overlap=True, grad_accum=8)
    argv = megatron_args(plan)
    with pytest.raises(ExportValidationError, match=match):
        validate_megatron_args(edit(argv), plan)


def test_validate_rejects_overlap_without_interleaving():
    plan = make_plan(MOE_SHAPE.model_copy(update={"layers": 96}), tp=2, pp=8, vpp=4, dp=16, ep=16, ep_overlap=True,
                     grad_accum=16)
    argv = megatron_args(plan)
    i = argv.index("--num-layers-per-virtual-pipeline-stage")
    del argv[i:i + 2]
    with pytest.raises(ExportValidationError, match="virtual_pipeline_model_parallel_size must be specified"):
        validate_megatron_args(argv, plan)


# --------------------------------------------------------------------------------------------------
# Tensor/data-parallel communication overlap
# --------------------------------------------------------------------------------------------------

def test_comm_overlap_exports_megatrons_flags():
    plan = make_plan(zero=1, comm_overlap=True)
    argv = megatron_args(plan)
    for flag in ("--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather"):
        assert flag in argv
    validate_megatron_args(argv, plan)
    ns = parse_megatron_args(argv)
    assert ns.tp_comm_overlap and ns.overlap_grad_reduce and ns.overlap_param_gather and ns.sequence_parallel
    # no distributed optimizer: the gradient all-reduce overlap alone; no tensor parallelism: no TP overlap
    plain_dp = megatron_args(make_plan(tp=1, dp=32, comm_overlap=True))
    assert "--overlap-grad-reduce" in plain_dp and "--overlap-param-gather" not in plain_dp
    assert "--tp-comm-overlap" not in plain_dp
    assert not {"--tp-comm-overlap", "--overlap-grad-reduce"} & set(megatron_args(make_plan()))


@pytest.mark.parametrize("edit, match", [
    (lambda a: [x for x in a if x != "--sequence-parallel"], "only when sequence parallelism is enabled"),
    (lambda a: [x for x in a if x != "--use-distributed-optimizer"], "only supported with distributed optimizer"),
    (lambda a: [x for x in a if x != "--overlap-grad-reduce"], "Must use --overlap-param-gather with"),
])
def test_validate_applies_megatrons_comm_overlap_rules(edit, match):
    plan = make_plan(zero=1, comm_overlap=True)
    with pytest.raises(ExportValidationError, match=match):
        validate_megatron_args(edit(megatron_args(plan)), plan)


def test_partial_checkpointing_is_megatrons_block_method():
    """checkpoint_layers N: --recompute-method block --recompute-num-layers N (the first N layers of each pipeline
    stage), checked against Megatron's rules (at most the layers of a pipeline rank) and against the plan."""
    plan = make_plan(vpp=1, checkpointing="full", checkpoint_layers=5)  # 80 layers over pp 4: 20 per rank
    argv = megatron_args(plan)
    ns = parse_megatron_args(argv)
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == ("full", "block", 5)
    validate_megatron_args(argv, plan)
    with pytest.raises(ExportValidationError, match="between 1 and the 20 layers of a pipeline rank"):
        validate_megatron_args(replaced(argv, "--recompute-num-layers", "21"), plan)
    with pytest.raises(ExportValidationError, match="--recompute-num-layers is 6 in the arguments but the plan needs 5"):
        validate_megatron_args(replaced(argv, "--recompute-num-layers", "6"), plan)  # not the plan's 5
    every = make_plan(vpp=1, checkpointing="full")
    with pytest.raises(ExportValidationError):
        validate_megatron_args(argv, every)  # the plan recomputes every layer: uniform, 1
