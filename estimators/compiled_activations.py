"""What the blocks compiled by torch.compile save for the backward, against the eager profile optplan prices them
by: measured, stated as a note, not priced (dimensionless shares).

TorchInductor's min-cut partitioner (``torch/_functorch/partitioners.py``) recomputes cheap pointwise operators in
the backward instead of saving their outputs. How much that saves depends on the model's code: measured on this
CPU by benchmarks/compiled_activations_cpu.py (four blocks at dim 512, 8,192 tokens, bf16; bytes per token per
layer over h, eager -> compiled): examples/llama.py's block (RMSNorm in fp32, rotary embeddings, repeated key/value
heads, SwiGLU) 52.1 -> 36.6 without checkpointing and 15.1 -> 13.1 under the op-level selective policy; examples/
gpt2.py's block (fused LayerNorm and GELU) 31.6 -> 31.6 and 17.6 -> 17.6. torchtitan's compiled 8B runs reserved
5.0-5.4 GiB less than its eager ones at the same plan (benchmarks/fidelity_torchtitan.py t1/t3), about the 2 h per
token per layer measured under selective checkpointing (4.0 GiB there). A profile measures its model eager (on fake
tensors), so the compiled share of a model file's layers is unknown until a profile measures its compiled blocks:
the note states the range.
"""

from __future__ import annotations

from optplan.estimators.profile import ModelProfile
from optplan.estimators.strategy import Strategy

COMPILED_SAVED_SHARE: dict[str, float] = {"none": 0.702, "selective": 0.867}
"""Compiled over eager saved bytes of examples/llama.py's block (module docstring), by checkpointing mode: the
largest saving measured (GPT-2's block: 1.000 in both). Kept equal to benchmarks/results/compiled_activations_cpu.txt
by tests/benchmarks/test_compiled_activations_cpu.py."""


def compiled_activations_note(profile: ModelProfile, strategy: Strategy) -> str | None:
    """One note for a plan that compiles the blocks of a transformer and keeps their activations (no or selective
    checkpointing; full checkpointing keeps the blocks' inputs only): its layers may hold less than priced."""
    if not strategy.compile or profile.transformer is None or strategy.checkpointing not in COMPILED_SAVED_SHARE:
        return None
    share = COMPILED_SAVED_SHARE[strategy.checkpointing]
    return (f"memory: the compiled blocks are priced with the eager model's saved activations; TorchInductor "
            f"recomputes pointwise operators instead of saving them, as far as the model's code allows (measured "
            f"on the CPU, benchmarks/compiled_activations_cpu.py: a Llama block saves {100 * (1 - share):.0f} % "
            f"less under {strategy.checkpointing} checkpointing, a GPT-2 block nothing), so the layers' activations "
            "may be that much lower than priced")


__all__ = ["COMPILED_SAVED_SHARE", "compiled_activations_note"]
