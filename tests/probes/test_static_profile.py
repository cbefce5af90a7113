"""The static profile: fake-tensor activations vs real CPU steps, depth extrapolation, FLOPs, speed."""

from __future__ import annotations

import os
import resource
import textwrap
import time

import pytest
import torch

from optplan.probes.activation_measure import fit_activations, measure
from optplan.probes.contract import load_contract
from optplan.probes.loader import profile_model_file
from optplan.probes.model_census import factored_state_elements
from optplan.probes.static import blocks_of, find_repeated_block, measure_fake, profile_contract
from optplan.probes.step_runner import StepRunner, batch_spec

BATCHES = (1, 2)


def real_fits(contract, seq_len: int):
    """Activation fits and FLOPs of a REAL CPU model at full depth, same definition and tracker."""
    torch.manual_seed(0)
    model = contract.builder()  # real weights (small models only)
    block = find_repeated_block(model)
    spec, _ = batch_spec(contract, model, seq_len)
    runner = StepRunner(model=model, spec=spec, loss_fn=contract.loss_fn, display=contract.display,
                        blocks=blocks_of(model, block.cls if block else None))
    m = measure(runner, BATCHES)
    return {(f.precision, f.checkpointing): f for f in fit_activations(m.envelopes)}, m


def fake_full_depth_fits(contract, seq_len: int):
    meta = contract.build_meta()
    block = find_repeated_block(meta)
    spec, _ = batch_spec(contract, meta, seq_len)
    m = measure_fake(meta, spec, contract, block.cls if block else None, BATCHES)
    return {(f.precision, f.checkpointing): f for f in fit_activations(m.envelopes)}, m


def assert_fits_close(got, want, rel=0.01):
    assert set(got) == set(want)
    for mode, fit in want.items():
        for b in (1, 2, 3, 4, 8, 32):
            assert got[mode].bytes_at(b) == pytest.approx(fit.bytes_at(b), rel=rel), (mode, b)
            assert got[mode].bytes_at(b, param_copies=False) == pytest.approx(
                fit.bytes_at(b, param_copies=False), rel=rel), (mode, b)
        assert got[mode].param_copy_bytes == pytest.approx(fit.param_copy_bytes, rel=rel, abs=64), mode


def test_fake_profile_matches_a_real_cpu_step_small_gpt(small_gpt_file):
    contract = load_contract(small_gpt_file)
    profile = profile_contract(contract)  # 4 layers: profiled with 1 and 2 blocks, extrapolated
    assert profile.profiled_blocks == 2 and "profiled 2 of 4 blocks and scaled by layers" in profile.notes
    real, real_m = real_fits(contract, 64)
    fake, fake_m = fake_full_depth_fits(contract, 64)
    extrapolated = {(f.precision, f.checkpointing): f for f in profile.activations}
    assert set(real) == {(p, c) for p in ("fp32", "bf16", "bf16-weights") for c in ("none", "selective", "full")}
    assert_fits_close(fake, real)  # fake tensors == real tensors (full depth)
    assert_fits_close(extrapolated, real)  # depth-reduced profile == real full depth
    assert real[("bf16", "none")].param_copy_bytes > 0 and real[("fp32", "none")].param_copy_bytes == 0
    assert real[("fp32", "full")].per_sample_bytes < real[("fp32", "none")].per_sample_bytes
    # the training loop's selective policy (every other matmul's output and the attention output kept): its
    # backward re-runs each block's second linear (attention c_proj, 128 -> 128, for the residual sum that c_fc
    # reads); the fourth (the MLP's c_proj) is not re-run, as backward never reads its output: 2·h·h per token
    assert profile.selective_recompute_flops_per_sample == 2 * 128 * 128 * 64 * 4
    assert real_m.selective_recompute_flops == fake_m.selective_recompute_flops == 2 * 128 * 128 * 64 * 4  # b = 1
    assert (real[("fp32", "full")].per_sample_bytes < real[("fp32", "selective")].per_sample_bytes
            < real[("fp32", "none")].per_sample_bytes)
    # the model held in bf16: its activations and gradient temporaries are 16-bit, no autocast copies
    weights16 = real[("bf16-weights", "none")]
    assert weights16.param_copy_bytes == 0
    assert weights16.per_sample_bytes < real[("bf16", "none")].per_sample_bytes
    assert weights16.bytes_at(1) < real[("bf16", "none")].bytes_at(1, param_copies=False)
    assert (fake_m.fwd_flops, fake_m.bwd_flops) == (real_m.fwd_flops, real_m.bwd_flops)
    assert profile.fwd_flops_per_sample == pytest.approx(real_m.fwd_flops, rel=1e-9)
    assert profile.bwd_flops_per_sample == pytest.approx(real_m.bwd_flops, rel=1e-9)


def test_fake_profile_matches_a_real_cpu_step_mlp(examples_dir):
    contract = load_contract(examples_dir / "mlp.py")
    profile = profile_contract(contract)
    real, real_m = real_fits(contract, 1024)
    assert_fits_close({(f.precision, f.checkpointing): f for f in profile.activations}, real)
    assert profile.fwd_flops_per_sample == pytest.approx(real_m.fwd_flops, rel=1e-9)
    assert profile.repeated_block is not None and profile.repeated_block.path == "blocks"


def test_extrapolation_is_exact_for_a_deeper_llama(write_model, examples_dir):
    """8 layers and a large vocabulary: the peak moves between forward and backward with depth."""
    path = write_model(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("optplan_example_llama", {str(examples_dir / "llama.py")!r})
        llama = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = llama
        spec.loader.exec_module(llama)
        OPTPLAN = {{"seq_len": 128}}

        def build_model():
            return llama.build_model("8B", dim=256, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=512,
                                     vocab_size=32000)
        loss_fn = llama.loss_fn
        """)
    contract = load_contract(path)
    profile = profile_contract(contract)
    assert profile.profiled_blocks == 2 and profile.transformer.kv_heads == 2
    assert any("inferred token-id batch" in n for n in profile.notes)
    full, m = fake_full_depth_fits(contract, 128)
    assert_fits_close({(f.precision, f.checkpointing): f for f in profile.activations}, full, rel=1e-6)
    assert profile.fwd_flops_per_sample == m.fwd_flops


@pytest.fixture(scope="module")
def gpt2_small_run():
    start = time.perf_counter()
    profile = profile_model_file(os.path.join(os.path.dirname(__file__), "../../examples/gpt2.py"))
    return profile, time.perf_counter() - start


def test_gpt2_small_profile(gpt2_small_run):
    """What the profile reads off GPT-2 small. Its wall time is printed, not asserted: tests do not depend on
    wall-clock time (a loaded CI machine once took 15.4 s against the old 15 s assertion); benchmarks/bench_recommend.py
    times `optplan recommend` end to end."""
    profile, wall = gpt2_small_run
    print(f"\ngpt2 small: profile_s={profile.profile_s:.2f} wall={wall:.2f}s")
    assert profile.params == profile.trainable_params == 124_439_808
    assert profile.params_by_module == {"transformer": 124_439_808, "lm_head": 0}
    assert profile.repeated_block.class_name == "Block" and profile.repeated_block.count == 12
    assert profile.repeated_block.params_per_block == 7_087_872
    assert profile.repeated_block.path == "transformer.h"
    assert profile.transformer.hidden == 768 and profile.transformer.vocab == 50257
    assert profile.input_kind == "tokens" and profile.seq_len == profile.tokens_per_sample == 1024
    assert profile.profiled_blocks == 2 and profile.torch_version == torch.__version__
    assert profile.defaults.precision == "amp-bf16"
    assert profile.supports_checkpointing and len(profile.activations) == 9  # fp32, autocast, bf16 weights x 3


def test_gpt2_small_flops_match_the_formula(gpt2_small_run):
    profile, _ = gpt2_small_run
    n, layers, d, t = 124_439_808, 12, 768, 1024
    attention = 3 * layers * 2 * (2 * t * t * d)  # QK^T and AV, forward + 2x backward, per sample
    formula = 6 * n * t + attention
    measured = profile.train_flops_per_sample
    assert measured == pytest.approx(formula, rel=0.02)
    assert measured * 8 == pytest.approx(7.000e12, rel=0.001)  # stack-notes: B=8, T=1024, math SDPA
    assert profile.bwd_flops_per_sample == pytest.approx(2 * profile.fwd_flops_per_sample, rel=1e-6)


def test_resnet50_profile(examples_dir):
    profile = profile_contract(load_contract(examples_dir / "resnet.py"))
    assert profile.params == 25_557_032 and profile.buffer_bytes > 0
    assert profile.repeated_block.class_name == "Bottleneck" and profile.repeated_block.count == 16
    assert profile.repeated_block.path is None and profile.profiled_blocks is None  # 4 stages: full depth
    assert profile.input_kind == "other" and profile.seq_len is None
    assert profile.fwd_flops_per_sample == pytest.approx(2 * 4.09e9, rel=0.02)  # 4.09 GMACs
    assert profile.activation("fp32", "none").per_sample_bytes > profile.activation("fp32", "full").per_sample_bytes


@pytest.mark.slow
def test_llama_70b_profiles_small(examples_dir, monkeypatch):
    monkeypatch.setenv("OPTPLAN_LLAMA_SIZE", "70B")
    start = time.perf_counter()
    profile = profile_model_file(examples_dir / "llama.py", use_cache=False)  # a child runs: its RSS is measured
    wall = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # largest child so far
    print(f"\nllama 70B: profile_s={profile.profile_s:.2f} wall={wall:.2f}s child peak RSS <= {peak_rss / 2**30:.2f} GiB")
    assert peak_rss < 4 * 2**30  # the wall time is printed, not asserted (bench_recommend.py times recommend)
    assert profile.params == 70_553_706_496 and profile.name == "llama-70B"
    assert profile.profiled_blocks == 2 and "profiled 2 of 80 blocks and scaled by layers" in profile.notes
    assert profile.transformer.layers == 80 and profile.transformer.kv_heads == 8
    six_n_t = 6 * profile.params * 4096
    assert profile.train_flops_per_sample == pytest.approx(six_n_t, rel=0.15)  # + attention at 4k
    bf16 = profile.activation("bf16", "full")
    assert bf16.param_copy_bytes == pytest.approx(2 * (profile.params - 128256 * 8192), rel=0.01)


def test_root_sequential_and_uncopyable_blocks_are_cut_by_rebuilding(write_model, monkeypatch):
    import optplan.probes.static as static

    depths: list[int] = []  # the cut depths measured in full (~40 steps each)

    def spy(model, *args, **kwargs):
        depths.append(len(model))
        return measure_fake(model, *args, **kwargs)

    monkeypatch.setattr(static, "measure_fake", spy)
    path = write_model("""
        import threading
        import torch, torch.nn as nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.lock = threading.Lock()  # cannot be deep-copied: the profile rebuilds instead
                self.fc = nn.Linear(32, 32)
            def forward(self, x):
                return x + torch.nn.functional.gelu(self.fc(x))

        def build_model():
            return nn.Sequential(*[Block() for _ in range(5)])

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 32)
        """)
    contract = load_contract(path)
    profile = profile_contract(contract)
    assert profile.repeated_block.path == "" and profile.repeated_block.count == 5
    assert profile.profiled_blocks == 3  # the first block gets no input gradient: 2 and 3 measured
    assert depths == [2, 3]  # one warm-up step told so: depth 1, off the line, was not measured
    assert "profiled 3 of 5 blocks and scaled by layers" in profile.notes
    full, m = fake_full_depth_fits(contract, 1024)
    assert_fits_close({(f.precision, f.checkpointing): f for f in profile.activations}, full, rel=1e-6)
    assert profile.fwd_flops_per_sample == m.fwd_flops == 5 * 2 * 32 * 32


def test_models_that_cannot_be_cut_are_profiled_at_full_depth(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.n_layers = 4
                self.inp = nn.Linear(8, 16)
                self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(self.n_layers)])
            def forward(self, x):
                h = self.inp(x)
                for i in range(self.n_layers):  # indexes by the configured depth: a cut list fails
                    h = torch.relu(self.layers[i](h))
                return h.sum()

        def build_model():
            return Net()

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 8)
        """)
    profile = profile_contract(load_contract(path))
    assert profile.profiled_blocks is None
    assert any("could not profile with the block list cut" in n and "IndexError" in n for n in profile.notes)
    assert profile.fwd_flops_per_sample == 2 * (8 * 16 + 4 * 16 * 16)


# --- Adafactor's factored second-moment elements (Shazeer & Stern 2018; torch.optim.Adafactor) ------


TINY_SOURCE = """
import torch
import torch.nn as nn


class Tiny(nn.Module):
    \"\"\"Known shapes: tied embedding/head, a 3-D conv weight, a frozen Linear, a 0-D scale.\"\"\"

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)  # 10x4: 10 + 4 = 14
        self.conv = nn.Conv1d(4, 6, 3)  # weight 6x4x3: 6 x (4 + 3) = 42; bias 6
        self.proj = nn.Linear(4, 5)  # weight 5x4: 9; bias 5
        self.frozen = nn.Linear(4, 4)  # requires_grad False: no optimizer state
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once
        self.scale = nn.Parameter(torch.ones(()))  # 0-D: 1

    def forward(self, x):
        e = self.emb(x)
        c = self.conv(e.transpose(1, 2)).mean()
        h = self.frozen(e) * self.scale + c
        return self.head(h) + self.proj(e).sum(-1, keepdim=True)
"""
_ns: dict = {}
exec(TINY_SOURCE, _ns)  # noqa: S102 - the test's own source, also written as a model file below
_Tiny = _ns["Tiny"]


TINY_FACTORED = 14 + 42 + 6 + 9 + 5 + 1  # 77


def test_factored_state_elements_by_hand():
    model = _Tiny()
    assert factored_state_elements(model) == TINY_FACTORED
    with torch.device("meta"):
        assert factored_state_elements(_Tiny()) == TINY_FACTORED  # shapes only: the meta model counts the same


def test_factored_state_elements_match_torch_adafactor_state():
    """The count equals the elements torch.optim.Adafactor really allocates (row_var, col_var, variance)."""
    torch.manual_seed(0)
    model = _Tiny()
    opt = torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randint(0, 10, (2, 7))).float().pow(2).mean().backward()
    opt.step()
    allocated = sum(t.numel() for state in opt.state.values() for k, t in state.items() if k != "step")
    assert allocated == factored_state_elements(model) == TINY_FACTORED


def test_profile_carries_factored_state_elements(write_model):
    path = write_model(TINY_SOURCE + textwrap.dedent("""
        OPTPLAN = {"seq_len": 8}

        def build_model():
            return Tiny()

        def example_batch(batch_size, seq_len):
            return torch.randint(0, 10, (batch_size, seq_len))

        def loss_fn(output, batch):
            return output.float().pow(2).mean()
        """))
    profile = profile_contract(load_contract(path))
    assert profile.factored_state_elements == TINY_FACTORED
    assert profile.params == 40 + 72 + 6 + 25 + 20 + 1  # tied head once, the frozen Linear included
    assert profile.trainable_params == profile.params - 20


def test_arch_formula_matches_a_built_decoder():
    """estimators.arch's parameter and Adafactor counts equal those of a torch decoder of that shape."""
    from optplan.estimators.arch import (
        ArchSpec,
        arch_factored_state_elements,
        arch_params,
        arch_small_param_counts,
    )
    from optplan.probes.model_census import small_param_counts

    nn = torch.nn
    h, heads, kv_heads, ffn, vocab, seq, layers = 16, 4, 2, 40, 50, 12, 3
    kv = h * kv_heads // heads

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = nn.Linear(h, h), nn.Linear(h, kv), nn.Linear(h, kv), nn.Linear(h, h)
            self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            self.head = nn.Linear(h, vocab, bias=False)
            self.head.weight = self.wte.weight

    with torch.device("meta"):
        model = Decoder()
    spec = ArchSpec(layers=layers, hidden=h, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq)
    assert sum(p.numel() for p in model.parameters()) == arch_params(spec)[0]
    assert factored_state_elements(model) == arch_factored_state_elements(spec)
    assert small_param_counts(model) == arch_small_param_counts(spec)
    assert small_param_counts(model, limit=h) == {kv: 2 * layers, h: 7 * layers + 2}


def test_gpt2_small_factored_state_elements(gpt2_small_run):
    """nanoGPT GPT-2 small: per layer c_attn 3h x h (4h + 3h bias), c_proj (2h + h), c_fc 4h x h (5h + 4h),
    mlp c_proj h x 4h (5h + h), two LayerNorms (4h) = 29h; tied wte (V + h), wpe (1024 + h), ln_f (2h)."""
    profile, _ = gpt2_small_run
    h = 768
    assert profile.factored_state_elements == 12 * 29 * h + (50257 + h) + (1024 + h) + 2 * h == 321_617


# --- the activation envelope: lines over the micro-batch, per phase, extrapolated over depth -----------


def test_upper_envelope_keeps_the_lines_that_are_the_maximum_somewhere():
    from optplan.probes.envelope import upper_envelope, value_at

    lines = [(100, 0), (60, 20), (0, 40), (10, 10), (-500, 60), (90, 0), (40, 20)]
    env = upper_envelope(lines)
    # the maximum is (100, 0) up to b = 2, (60, 20) to 3, (0, 40) to 25, then (-500, 60); (10, 10) is
    # under (100, 0) up to b = 9 and under (60, 20) after; (90, 0) and (40, 20) are below a line of the
    # same slope
    assert env == ((100, 0), (60, 20), (0, 40), (-500, 60))
    for b in (1, 2, 2.5, 3, 10, 25, 100):
        assert value_at(env, b) == max(a + c * b for a, c in lines)
    # a line that is the maximum at one point only is dropped
    assert upper_envelope([(100, 0), (50, 20), (0, 40)]) == ((100, 0), (0, 40))
    # a line that wins only below b_min is dropped
    assert upper_envelope([(10, 0), (5, 6)], b_min=1) == ((5, 6),)
    assert upper_envelope([(10, 0), (5, 6)], b_min=0) == ((10, 0), (5, 6))
    assert upper_envelope([]) == ()


def test_step_envelope_from_timelines_and_depth():
    from optplan.probes.envelope import StepEnvelope

    # per phase, (live, live without copies) after each allocation at micro-batch 1 and 2
    t1 = {"stem": [(10, 10)], "forward": [(100, 60), (130, 90)], "backward": [(150, 110), (120, 120)],
          "stem_backward": [(300, 300)]}
    t2 = {"stem": [(20, 20)], "forward": [(180, 140), (250, 210)], "backward": [(290, 250), (230, 230)],
          "stem_backward": [(310, 310)]}
    env = StepEnvelope.from_timelines(t1, t2, (1, 2))
    assert env.total["backward"] == ((10, 140),) and env.total["stem_backward"] == ((290, 10),)
    assert env.lines() == ((290, 10), (10, 140))  # the embedding's backward first, then the backward's start
    assert [env.at(b) for b in (1, 2, 3, 4)] == [300, 310, 430, 570]
    assert [env.at(b, bare=True) for b in (1, 2, 3)] == [300, 310, 390]
    # one block fewer: forward and backward shrink by a line over b, the embedding's backward does not
    shallower = StepEnvelope.from_timelines(
        {"stem": [(10, 10)], "forward": [(70, 40), (80, 50)], "backward": [(90, 60), (70, 70)],
         "stem_backward": [(300, 300)]},
        {"stem": [(20, 20)], "forward": [(120, 90), (140, 110)], "backward": [(160, 130), (130, 130)],
         "stem_backward": [(310, 310)]}, (1, 2))
    deeper = env.deeper(shallower, 3)  # three more blocks
    assert deeper.total["backward"] == ((10 + 3 * -10, 140 + 3 * 70),)
    assert deeper.total["stem_backward"] == env.total["stem_backward"]
    # timelines that do not line up (a batch-size dependent branch) fall back to a line through the peaks
    odd = StepEnvelope.from_timelines({"forward": [(5, 5), (9, 9)]}, {"forward": [(12, 12)]}, (1, 2))
    assert odd.total == {"forward": ((6, 3),)} and odd.misaligned == ("forward",)
    assert env.misaligned == () and odd.deeper(odd, 2).misaligned == ("forward",)


def test_a_phase_that_lines_up_only_from_two_samples_on_is_refitted_there():
    from optplan.probes.envelope import StepEnvelope

    # micro-batch 1 skips a copy (a view at one sample): 2 allocations of 'loss' at 1, 3 at 2 and at 3
    at1 = {"forward": [(100, 100)], "loss": [(100, 100), (110, 110)]}
    at2 = {"forward": [(200, 200)], "loss": [(200, 200), (240, 240), (250, 250)]}
    at3 = {"forward": [(300, 300)], "loss": [(300, 300), (360, 360), (375, 375)]}
    first = StepEnvelope.from_timelines(at1, at2, (1, 2))
    assert first.misaligned == ("loss",) and first.total["loss"] == ((-30, 140),)  # through the peaks: 140/sample
    refit = first.refitted(StepEnvelope.from_timelines(at2, at3, (2, 3)))
    assert refit.misaligned == () and refit.later == ("loss",)
    assert refit.total["forward"] == first.total["forward"]  # phases that lined up keep the fit from 1 and 2
    assert [refit.at(b) for b in (2, 3, 8)] == [250, 375, 1000]  # exact from 2 on: 125 per sample
    assert refit.at(1) == 125  # the later line at 1: above the 110 measured (a copy counted), never below
    # the first size's own peak stays a floor when the later lines fall below it there
    low = StepEnvelope.from_timelines({"loss": [(10, 10), (10, 10), (10, 10)]},
                                      {"loss": [(12, 12), (12, 12), (13, 13)]}, (2, 3))
    assert first.refitted(low).total["loss"] == ((110, 0), (4, 3))  # 110 at 1, 13 at 3 from the later line
    # a phase that lines up at neither pair keeps its line through the peaks
    assert first.refitted(StepEnvelope.from_timelines(at2, {"forward": [(300, 300)], "loss": [(1, 1)]}, (2, 3))
                          ) == first
    deeper = refit.deeper(first, 2)
    assert deeper.later == ("loss",) and deeper.misaligned == ("loss",)


def test_a_model_branching_on_the_batch_size_gets_a_note(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                h = self.fc(x)
                if x.shape[0] > 1:  # one more temporary for batches of several samples
                    h = h * 2
                return h.relu().sum()

        def build_model():
            return Net()

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 16)
        """)
    profile = profile_contract(load_contract(path))
    # one sample is the odd one out: the step is fitted through 2 and 3, where it runs the same operators
    assert any("micro-batch 1 ran other operators than 2 and 3" in n for n in profile.notes), profile.notes
    assert not any("ran different operators" in n for n in profile.notes)
    assert profile.activation("fp32", "none").bytes_at(2) > 0
    # a model that branches on the batch's parity differs at every pair: one line through the two peaks
    parity = write_model(path.read_text().replace("x.shape[0] > 1", "x.shape[0] % 2 == 0"), name="parity.py")
    profile = profile_contract(load_contract(parity))
    assert any("ran different operators at micro-batch 1 and 2" in n for n in profile.notes), profile.notes
    assert not any("ran other operators than" in n for n in profile.notes)


def test_activation_fit_lines_and_their_summary():
    from optplan.estimators.profile import ActivationFit, ModelProfile
    from optplan.probes.envelope import StepEnvelope, activation_fit

    env = StepEnvelope((1, 2), {"forward": ((500, 10),), "backward": ((0, 100),)},
                       {"forward": ((100, 10),), "backward": ((0, 90),)})
    fit = activation_fit("bf16", "full", env)
    assert fit.lines == ((500, 10), (0, 100)) and fit.lines_without_copies == ((100, 10), (0, 90))
    assert (fit.fixed_bytes, fit.per_sample_bytes) == (0, 100)  # the steepest line: the peak at large b
    assert fit.param_copy_bytes == 510 - 110  # at micro-batch 1
    assert [fit.bytes_at(b) for b in (1, 5, 6, 10)] == [510, 550, 600, 1000]
    assert [fit.bytes_at(b, param_copies=False) for b in (1, 2, 10)] == [110, 180, 900]
    assert [fit.param_copies_at(b) for b in (1, 2, 10)] == [400, 340, 100]
    assert [fit.fixed_at(b) for b in (1, 5, 10)] == [410, 50, 0]
    # without lines (hand-made, formula or older profiles) the single line, as before
    old = ActivationFit(precision="bf16", checkpointing="none", fixed_bytes=100, per_sample_bytes=7,
                        param_copy_bytes=30)
    assert old.bytes_at(2) == 114 and old.bytes_at(2, param_copies=False) == 84
    assert old.param_copies_at(2) == 30 and old.fixed_at(2) == 100
    assert ActivationFit(precision="fp32", checkpointing="none", fixed_bytes=-50, per_sample_bytes=10).bytes_at(2) == 0
    # the lines survive the JSON round trip of the profile (the child process sends JSON)
    assert ActivationFit.model_validate_json(fit.model_dump_json()) == fit
    assert ModelProfile.model_fields["param_numels"].default == ()


def test_profile_param_numels_in_optimizer_order(examples_dir):
    contract = load_contract(examples_dir / "mlp.py")
    profile = profile_contract(contract)
    model = contract.builder()
    assert profile.param_numels == tuple(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(profile.param_numels) == profile.trainable_params


def test_gpt2_small_param_numels_tie_once(gpt2_small_run):
    profile, _ = gpt2_small_run
    assert len(profile.param_numels) == 148 and sum(profile.param_numels) == 124_439_808
    assert profile.param_numels[0] == 50257 * 768  # wte, tied with lm_head: once


def test_a_model_that_fails_in_bf16_gets_a_note_and_no_16bit_fit(write_model):
    """A model that cannot train in bf16 (here it refuses, as a model with an fp32-only kernel would): its
    profile says so and its 16-bit recipes fall back to the autocast fit (estimators.memory.measured_fit)."""
    path = write_model("""
        import torch, torch.nn as nn

        class Fp32OnlyLinear(nn.Linear):
            def forward(self, x):
                if self.weight.dtype != torch.float32:
                    raise TypeError("this kernel is fp32 only")
                return super().forward(x)

        def build_model():
            return Fp32OnlyLinear(16, 16)

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 16)
        """)
    profile = profile_contract(load_contract(path))
    assert {f.precision for f in profile.activations} == {"fp32", "bf16"}
    assert not profile.has_activation("bf16-weights")
    assert any("does not train with bf16 weights" in n for n in profile.notes)
    assert profile.activation("fp32", "none").per_sample_bytes > 0  # the rest of the profile is intact
