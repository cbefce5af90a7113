"""Resolving the model-file contract in-process: candidates, OPTPLAN, batches, default losses, seq_len."""

from __future__ import annotations

import pytest
import torch

from optplan.probes.contract import default_loss, load_contract
from optplan.probes.loader import ModelFileError
from optplan.probes.static import profile_contract

TWO_CLASSES = """
    import torch, torch.nn as nn

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 2)
        def forward(self, x):
            return self.fc(x)

    class Big(nn.Module):
        def __init__(self, width=16):
            super().__init__()
            self.fc = nn.Linear(8, width)
        def forward(self, x):
            return self.fc(x)

    def example_batch(batch_size, seq_len):
        return torch.randn(batch_size, 8)
    """


def test_model_name_picks_one_of_several(write_model):
    path = write_model(TWO_CLASSES)
    with pytest.raises(ModelFileError, match="several models found.*--model-name Big"):
        load_contract(path)
    contract = load_contract(path, model_name="Small")
    assert type(contract.build_meta()).__name__ == "Small"
    assert contract.source == "class Small"
    with pytest.raises(ModelFileError, match="no such name.*Big, Small"):
        load_contract(path, model_name="Medium")


def test_instance_wins_and_keeps_tied_weights(write_model):
    path = write_model("""
        import torch.nn as nn

        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(100, 16)
                self.head = nn.Linear(16, 100, bias=False)
                self.head.weight = self.emb.weight
            def forward(self, idx):
                return self.head(self.emb(idx))

        model = Tied()
        """)
    contract = load_contract(path)
    assert contract.source == "instance model"
    meta = contract.build_meta()
    assert meta.head.weight.is_meta and meta.head.weight is meta.emb.weight
    profile = profile_contract(contract, seq_len=8)
    assert profile.params == 1600 and profile.input_kind == "tokens" and profile.tokens_per_sample == 8
    assert any("inferred token-id batch [B, S] from the embedding" in n for n in profile.notes)
    assert any("output.float().mean()" in n for n in profile.notes)



def test_a_learned_position_table_on_the_root_does_not_hide_the_embedding(write_model):
    """The root owns a parameter (a learned position table) before its embedding: the first layer is still the
    embedding, and token ids are inferred (it was "the first layer is Tied, not an nn.Embedding")."""
    path = write_model("""
        import torch, torch.nn as nn

        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.pos = nn.Parameter(torch.zeros(8, 16))
                self.emb = nn.Embedding(100, 16)
                self.head = nn.Linear(16, 100)
            def forward(self, idx):
                return self.head(self.emb(idx) + self.pos[: idx.shape[1]])

        def build_model():
            return Tied()
        """)
    profile = profile_contract(load_contract(path), seq_len=8)
    assert profile.input_kind == "tokens" and profile.tokens_per_sample == 8
    assert any("inferred token-id batch [B, S] from the embedding" in n for n in profile.notes)

def test_part_classes_and_classes_needing_arguments_are_not_candidates(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        class Block(nn.Module):            # constructible with defaults, but only a part of Net
            def __init__(self, dim=8):
                super().__init__()
                self.fc = nn.Linear(dim, dim)
            def forward(self, x):
                return torch.relu(self.fc(x))

        class Head(nn.Module):             # needs an argument: never a candidate
            def __init__(self, classes):
                super().__init__()
                self.fc = nn.Linear(8, classes)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(3)])
            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return x

        def example_batch(batch_size, seq_len):
            return torch.randn(batch_size, 8)
        """)
    contract = load_contract(path)
    assert contract.source == "class Net"
    assert any("no build_model()" in n for n in contract.notes)


def test_optplan_is_read_as_data(write_model):
    path = write_model("""
        import torch.nn as nn
        OPTPLAN = {"seq_len": 2048, "global_batch": 64, "tokens": "2e12", "optimizer": "adamw",
                   "precision": "bf16", "name": "tiny", "lr": 3e-4, "warmup": 100, "schedule": ["cos"]}

        def build_model():
            return nn.Linear(4, 4)
        """)
    contract = load_contract(path)
    d = contract.defaults
    assert (d.seq_len, d.global_batch, d.tokens, d.optimizer, d.precision) == (2048, 64, 2e12, "adamw", "bf16")
    assert d.extra == {"name": "tiny", "lr": 3e-4, "warmup": 100}
    assert contract.name == "tiny"
    assert any("schedule" in n and "ignored" in n for n in contract.notes)
    assert not any("did you mean" in n for n in contract.notes)  # lr, warmup: the file's own settings


def test_an_optplan_key_spelled_close_to_one_optplan_reads_gets_a_note(write_model):
    path = write_model("""
        import torch.nn as nn
        OPTPLAN = {"precison": "bf16", "seqlen": 512, "image_size": 224}

        def build_model():
            return nn.Linear(4, 4)
        """)
    contract = load_contract(path)
    assert contract.defaults.precision is None and contract.defaults.seq_len is None
    notes = [n for n in contract.notes if "did you mean" in n]
    assert len(notes) == 2, contract.notes
    assert "OPTPLAN['precison'] is not a key optplan reads (did you mean 'precision'?)" in notes[0]
    assert "did you mean 'seq_len'?" in notes[1]


@pytest.mark.parametrize("value, message", [
    ('{"global_batch": 0}', "global_batch"), ('{"tokens": "lots"}', "tokens"),
    ('{"optimizer": 3}', "optimizer"), ('{"seq_len": True}', "seq_len"), ("42", "must be a dict"),
])
def test_optplan_bad_values(write_model, value, message):
    path = write_model(f"import torch.nn as nn\nOPTPLAN = {value}\ndef build_model():\n    return nn.Linear(2, 2)\n")
    with pytest.raises(ModelFileError, match=message):
        load_contract(path)


def test_default_loss_rules():
    scalar = torch.tensor(2.0)
    vec = torch.ones(3)
    assert default_loss(scalar)[0] is scalar and "scalar" in default_loss(scalar)[1]
    assert default_loss({"logits": vec, "loss": scalar}) == (scalar, 'output["loss"]')
    loss, rule = default_loss((vec, scalar))
    assert loss is scalar and "first scalar tensor" in rule
    loss, rule = default_loss([None, vec * 2])
    assert loss.item() == 2.0 and ".float().mean()" in rule and "element 1" in rule
    assert default_loss(vec.long())[0].dtype == torch.float32
    with pytest.raises(TypeError):
        default_loss(("text",))
    # a dict names the key it took; "logits" (Hugging Face's prediction) before an earlier tensor
    loss, rule = default_loss({"hidden": vec, "logits": vec * 3})
    assert loss.item() == 3.0 and rule == "output['logits'].float().mean()"
    loss, rule = default_loss({"hidden": vec * 4, "scores": vec})
    assert loss.item() == 4.0 and "(output['hidden'])" in rule


def test_parameters_the_default_loss_skips_are_named(write_model):
    """A dict output whose first tensor skips a layer: the profile's backward never reaches it (the trial's model
    priced a step with no backward FLOPs and no note). The note names the parameters and the fix."""
    path = write_model("""
        import torch, torch.nn as nn

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb, self.lin = nn.Embedding(100, 64), nn.Linear(64, 100)
            def forward(self, x):
                h = self.emb(x)
                return {"hidden": h, "scores": self.lin(h)}

        def build_model():
            return M()

        OPTPLAN = {"seq_len": 32}
        """)
    profile = profile_contract(load_contract(path))
    note = next(n for n in profile.notes if "got no gradient" in n)
    assert "2 trainable parameter tensor(s) (50% of the trainable parameters: lin.weight, lin.bias)" in note, note
    assert "define loss_fn(output, batch)" in note and "output['hidden']" in note


TOKEN_MODEL = """
    import torch, torch.nn as nn

    class Cfg:
        max_position_embeddings = {max_pos}
        hidden_size = 16
        num_attention_heads = 2
        num_hidden_layers = 3
        vocab_size = 50

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Cfg()
            self.emb = nn.Embedding(50, 16)
            self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
            self.head = nn.Linear(16, 50)
        def forward(self, idx):
            h = self.emb(idx)
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            return {{"logits": self.head(h)}}
    {optplan}
    def build_model():
        return LM()
    """


@pytest.mark.parametrize("max_pos, optplan, arg, expected, source", [
    (96, "", 32, 32, "the seq_len argument"),
    (96, 'OPTPLAN = {"seq_len": 48}', None, 48, 'OPTPLAN["seq_len"]'),
    (96, "", None, 96, "the model's maximum position length"),
    ("None", "", None, 1024, "default for token models"),
])
def test_seq_len_precedence_and_token_inference(write_model, max_pos, optplan, arg, expected, source):
    path = write_model(TOKEN_MODEL.format(max_pos=max_pos, optplan=optplan))
    profile = profile_contract(load_contract(path), seq_len=arg)
    assert profile.input_kind == "tokens"
    assert profile.seq_len == profile.tokens_per_sample == expected
    assert any(source in n for n in profile.notes), profile.notes
    assert any("inferred token-id batch [B, S] from the embedding" in n for n in profile.notes)
    assert any("no loss_fn" in n and "output['logits']" in n for n in profile.notes), profile.notes
    assert not any("got no gradient" in n for n in profile.notes)
    assert profile.repeated_block is not None and profile.repeated_block.count == 3
    assert profile.repeated_block.path == "layers" and profile.profiled_blocks == 2
    if max_pos != "None":
        assert profile.transformer is not None
        assert (profile.transformer.hidden, profile.transformer.layers, profile.transformer.heads) == (16, 3, 2)
        assert profile.transformer.max_seq_len == max_pos


def test_other_inputs_have_no_seq_len(example, examples_dir):
    profile = profile_contract(load_contract(examples_dir / "mlp.py"))
    assert profile.input_kind == "other" and profile.seq_len is None and profile.tokens_per_sample is None
    assert any("example_batch was called with seq_len=1024" in n for n in profile.notes)
    assert profile.defaults.global_batch == 256
    assert profile.params_by_module == {"inp": 64 * 256 + 256, "blocks": 4 * 526_080, "head": 2570}
    assert sum(profile.params_by_module.values()) == profile.params


SEQ_OR_NOT = """
    import torch, torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
        def forward(self, x):
            return self.fc(x).sum()

    def build_model():
        return Net()

    def example_batch(batch_size, seq_len):
        return torch.randn(batch_size, {rows}, 8)

    def loss_fn(out, batch):
        return out
    """


def test_a_seq_len_argument_the_inputs_ignore_is_refused_and_one_they_use_is_kept(write_model):
    """--seq-len sets the tokens per sample; on a model whose example_batch makes the same inputs at any seq_len it
    would change nothing and is refused, while a float sequence sized by it is profiled at it."""
    fixed = write_model(SEQ_OR_NOT.format(rows=4), "fixed.py")
    with pytest.raises(ModelFileError, match=r"--seq-len 64 changes nothing.*drop --seq-len"):
        profile_contract(load_contract(fixed), seq_len=64)
    assert profile_contract(load_contract(fixed)).seq_len is None  # without the argument: profiled as before
    sized = profile_contract(load_contract(write_model(SEQ_OR_NOT.format(rows="seq_len"), "sized.py")), seq_len=64)
    assert sized.input_kind == "other" and sized.seq_len == 64


def test_dict_batch_is_passed_as_keywords(write_model):
    path = write_model("""
        import torch, torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 1)
            def forward(self, features, scale):
                return (self.fc(features) * scale).sum()

        def build_model():
            return Net()

        def example_batch(batch_size, seq_len):
            return {"features": torch.randn(batch_size, 4), "scale": torch.tensor(2.0)}
        """)
    profile = profile_contract(load_contract(path))
    assert profile.params == 5 and profile.repeated_block is None
    assert [(f.precision, f.checkpointing) for f in profile.activations] == [("fp32", "none"), ("bf16", "none"),
                                                                            ("bf16-weights", "none")]
    assert any("scalar tensor" in n for n in profile.notes)
    assert profile.fwd_flops_per_sample == 2 * 4  # one [1,4]x[4,1] matmul
