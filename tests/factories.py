"""Hand-built profiles and GPUs so estimator, planner and face tests need no torch.

A module of its own (tests/ is on sys.path through tests/conftest.py): ``from conftest import ...`` in a
test module resolves to whichever conftest pytest imported last (tests/probes/ has its own), so tests
collected after tests/probes/ import these from here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from optplan.estimators.arch import parse_arch, profile_from_arch
from optplan.estimators.hardware import Cluster, GPUSpec, find_gpu
from optplan.estimators.profile import ActivationFit, ModelProfile, RepeatedBlock, TransformerShape
from optplan.estimators.strategy import Strategy


def make_gpu(memory_gib: float = 80.0, *, bf16: bool = True) -> GPUSpec:
    """An H100-SXM-like GPU with round numbers, for hand-checked arithmetic."""
    peak = {"fp32": 50e12, "fp16": 1000e12}
    if bf16:
        peak["bf16"] = 1000e12
    return GPUSpec(name="TestGPU", memory_bytes=int(memory_gib * 2**30), memory_bandwidth_bytes_per_s=2e12,
                   peak_flops=peak, intra_node_bandwidth_bytes_per_s=400e9, tdp_watts=700, source="test")


def make_profile(params: int = 124_439_808, *, trainable: int | None = None, layers: int = 12,
                 hidden: int = 768, seq: int = 1024, act_bytes_per_token_layer: int = 34 * 768,
                 fixed_bytes: int = 0, tokens: bool = True) -> ModelProfile:
    """A transformer-like profile: 6·N FLOPs per token, Korthikanti-style activations (bf16 = 34·h
    bytes/token/layer, fp32 twice that, full checkpointing 2·h per layer + one layer's worth)."""
    flops = 6 * params * seq
    per_sample_bf16 = act_bytes_per_token_layer * seq * layers
    ckpt_bf16 = 2 * hidden * seq * layers + act_bytes_per_token_layer * seq
    fits = (
        ActivationFit(precision="bf16", checkpointing="none", fixed_bytes=fixed_bytes, per_sample_bytes=per_sample_bf16),
        ActivationFit(precision="fp32", checkpointing="none", fixed_bytes=fixed_bytes,
                      per_sample_bytes=2 * per_sample_bf16),
        ActivationFit(precision="bf16", checkpointing="full", fixed_bytes=fixed_bytes, per_sample_bytes=ckpt_bf16),
        ActivationFit(precision="fp32", checkpointing="full", fixed_bytes=fixed_bytes, per_sample_bytes=2 * ckpt_bf16),
    )
    return ModelProfile(
        name="testgpt", path="testgpt.py", model_class="GPT", params=params,
        trainable_params=params if trainable is None else trainable, params_by_module={"all": params},
        repeated_block=RepeatedBlock(class_name="Block", count=layers, params_per_block=params // layers * 9 // 10),
        input_kind="tokens" if tokens else "other", seq_len=seq if tokens else None,
        tokens_per_sample=seq if tokens else None, fwd_flops_per_sample=flops / 3,
        bwd_flops_per_sample=2 * flops / 3, activations=fits,
        transformer=TransformerShape(hidden=hidden, layers=layers, heads=max(1, hidden // 64)),
    )


DUALPIPE_MOE_ARCH = ("layers=16,hidden=2048,heads=16,ffn=8192,vocab=32000,gated=1,tied=0,experts=64,topk=8,moe_ffn=512,"
                     "shared_experts=1,first_dense=1,seq=4096")
"""A small DeepSeek-style MoE shape (64 experts, top-8, a shared expert, one dense first layer) for the DualPipe
tests: a 64-H100 plan with pp 4 and ep 8."""


def dualpipe_moe_plan(**kw: object) -> tuple[ModelProfile, Cluster, Strategy]:
    """(profile of :data:`DUALPIPE_MOE_ARCH`, 64 H100s, a Megatron DualPipe strategy with ``kw`` changed)."""
    fields = {"engine": "megatron", "precision": "bf16", "pp": 4, "dp": 16, "ep": 8, "zero": 1, "mbs": 1,
              "grad_accum": 16, "pp_schedule": "dualpipe", **kw}
    cluster = Cluster(gpu=find_gpu("H100-SXM"), gpus=64, gpus_per_node=8)
    return profile_from_arch(parse_arch(DUALPIPE_MOE_ARCH), name="moe"), cluster, Strategy(**fields)  # type: ignore[arg-type]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(file_name: str) -> ModuleType:
    """A script of benchmarks/ imported by path, once per process (``optplan_bench_<stem>`` in sys.modules): the
    tests that assert a benchmark's rows run its own code."""
    name = f"optplan_bench_{Path(file_name).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / file_name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
