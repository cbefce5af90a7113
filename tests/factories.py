"""Hand-built profiles and GPUs so estimator, planner and face tests need no torch.

A module of its own (tests/ is on sys.path through tests/conftest.py): ``from conftest import ...`` in a
test module resolves to whichever conftest pytest imported last (tests/probes/ has its own), so tests
collected after tests/probes/ import these from here.
"""

from __future__ import annotations

from optplan.estimators.hardware import GPUSpec
from optplan.estimators.profile import ActivationFit, ModelProfile, RepeatedBlock, TransformerShape


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
