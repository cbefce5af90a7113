"""A forward that needs tensor values (a branch on a tensor, data-dependent shapes) cannot run on fake
tensors: a small model is then profiled by a real CPU run; a large one, or a module-level instance, gets
the explanation instead."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from optplan.probes import static
from optplan.probes.contract import load_contract
from optplan.probes.model_errors import ModelFileError
from optplan.probes.static import profile_contract

MLP = """
import torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        {branch}
        return x + self.fc2(torch.relu(self.fc1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(32) for _ in range(4)])
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

{maker}

def example_batch(batch_size, seq_len):
    return torch.randn(batch_size, 32)
"""
BRANCH = "if x.abs().sum() < 0:  # never true, but Python needs the value\n            x = -x"


def _write(tmp_path: Path, name: str, *, branch: bool, instance: bool = False) -> Path:
    maker = "model = Net()" if instance else "def build_model():\n    return Net()"
    source = textwrap.dedent(MLP).replace("{branch}", BRANCH if branch else "pass").replace("{maker}", maker)
    path = tmp_path / name
    path.write_text(source)
    return path


def test_a_branch_on_a_tensor_is_profiled_by_a_real_run_with_the_fake_profiles_figures(tmp_path: Path) -> None:
    """Same operators with and without the branch: the real run gives the fake profile's FLOPs and
    activation bytes (same tracker, same fit), and says how it was profiled."""
    real = profile_contract(load_contract(_write(tmp_path, "branchy.py", branch=True)))
    fake = profile_contract(load_contract(_write(tmp_path, "plain.py", branch=False)))
    assert any("profiled by a real CPU run of the whole model at micro-batch 1 and 2" in n for n in real.notes)
    assert not any("real CPU run" in n for n in fake.notes)
    assert real.params == fake.params and real.param_numels == fake.param_numels
    assert real.fwd_flops_per_sample == fake.fwd_flops_per_sample
    assert real.bwd_flops_per_sample == fake.bwd_flops_per_sample
    assert real.profiled_blocks is None  # the whole model ran (the fake one was cut to 1-2 blocks)
    fits = {(f.precision, f.checkpointing): f for f in fake.activations}
    assert {(f.precision, f.checkpointing) for f in real.activations} == set(fits)
    for got in real.activations:
        want = fits[(got.precision, got.checkpointing)]
        for b in (1, 4, 32):
            assert got.bytes_at(b) == pytest.approx(want.bytes_at(b), rel=0.02), (got.precision, got.checkpointing, b)


def test_too_large_for_a_real_run_is_explained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(static, "REAL_RUN_MAX_BYTES", 1000)
    with pytest.raises(ModelFileError) as info:
        profile_contract(load_contract(_write(tmp_path, "branchy.py", branch=True)))
    assert "forward needs real tensor values" in info.value.problem
    assert "a real CPU run instead would hold" in info.value.problem and "GiB optplan allows" in info.value.problem
    assert "Python branches on tensor values" in info.value.fix


def test_a_module_level_instance_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as info:
        profile_contract(load_contract(_write(tmp_path, "instance.py", branch=True, instance=True)))
    assert "forward needs real tensor values" in info.value.problem
    assert "define build_model() so that optplan can profile it by a real CPU run" in info.value.fix
