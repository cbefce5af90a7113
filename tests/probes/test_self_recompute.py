"""A model that checkpoints itself: the profile counts what its backward re-runs (probes/self_recompute.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn as nn
from conftest import small_gpt_source
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from optplan.probes.contract import load_contract
from optplan.probes.self_recompute import module_reruns
from optplan.probes.static import profile_contract

SELF_CHECKPOINTED = """
import torch.nn.functional as F
import torch.utils.checkpoint


class SelfCheckpointed(gpt2.GPT):
    '''examples/gpt2.py's GPT whose forward wraps each block in torch.utils.checkpoint itself.'''

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant={reentrant})
        return self.lm_head(self.transformer.ln_f(x))


def build_model():
    model = gpt2.build_model(**CFG)
    model.__class__ = SelfCheckpointed
    return model
"""


def _profile(write_model, reentrant: bool | None):
    source = small_gpt_source()
    if reentrant is not None:
        source += textwrap.dedent(SELF_CHECKPOINTED.format(reentrant=reentrant))
    return profile_contract(load_contract(write_model(source, f"gpt_{reentrant}.py")))


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_model_checkpointing_its_blocks_has_its_recompute_counted_apart(write_model, reentrant):
    plain = _profile(write_model, None)
    own = _profile(write_model, reentrant)
    assert plain.self_recompute_flops_per_sample == 0
    assert not any("checkpoints itself" in n for n in plain.notes)
    assert own.profiled_blocks == plain.profiled_blocks == 2  # measured at 1 and 2 blocks, scaled to 4
    assert own.fwd_flops_per_sample == plain.fwd_flops_per_sample
    # the backward as the step runs it re-runs the blocks' forwards; what it re-ran is counted exactly
    rerun = own.bwd_flops_per_sample - plain.bwd_flops_per_sample
    assert rerun > 0 and own.self_recompute_flops_per_sample == pytest.approx(rerun, rel=1e-9)
    # the blocks' linear layers are 12·h² weights per block: the recompute is at most their forward, 4 blocks,
    # 64 tokens (plus the attention core); non-reentrant checkpoints stop once backward has what it needs
    linear = 2 * 12 * 128 * 128 * 64 * 4
    assert 0.5 * linear < own.self_recompute_flops_per_sample < 1.5 * linear
    # model FLOPs (MFU's) are the plain model's; the step's are the plain model's plus the recompute
    assert own.train_flops_per_sample == pytest.approx(plain.train_flops_per_sample, rel=1e-9)
    assert own.step_flops_per_sample == pytest.approx(plain.train_flops_per_sample + rerun, rel=1e-9)
    note = next(n for n in own.notes if "checkpoints itself" in n)
    share = own.self_recompute_flops_per_sample / own.fwd_flops_per_sample
    assert f"re-runs {share:.0%} of its forward's FLOPs" in note


def test_module_reruns_counts_only_module_forwards_run_during_backward():
    torch.manual_seed(0)
    inner, outer = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = outer(checkpoint(inner, x, use_reentrant=False)).sum()
    with FlopCounterMode(display=False) as bwd, module_reruns(bwd) as reruns:
        y.backward()
    one = 2 * 8 * 16 * 16
    assert fwd.get_total_flops() == 3 * one
    # the checkpoint re-runs inner's first linear (its output is what the second's weight gradient reads) and stops
    # there: torch's non-reentrant checkpoint recomputes only up to the last tensor backward needs
    assert reruns.calls == 1 and reruns.flops == one
    assert bwd.get_total_flops() == one + 2 * 3 * one  # the re-run, then three linears' input and weight gradients
    y = outer(inner(x)).sum()
    with FlopCounterMode(display=False) as bwd2, module_reruns(bwd2) as none:
        y.backward()
    assert none.calls == 0 and none.flops == 0
