"""The rotary base and normalisation epsilon read from a model's config (probes/model_shape.py), including
transformers 5's ``rope_parameters`` mapping, and carried on the TransformerShape."""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from optplan.probes.model_shape import read_transformer_shape


class _Model(nn.Module):
    def __init__(self, **config: object) -> None:
        super().__init__()
        self.config = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **config)


def test_the_config_states_them() -> None:
    shape = read_transformer_shape(_Model(rope_theta=1e6, rms_norm_eps=1e-6), None)
    assert shape is not None and (shape.rope_theta, shape.norm_eps) == (1e6, 1e-6)


def test_transformers_5_keeps_the_rotary_base_in_rope_parameters() -> None:
    shape = read_transformer_shape(_Model(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                          layer_norm_eps=1e-5), None)
    assert shape is not None and (shape.rope_theta, shape.norm_eps) == (500000.0, 1e-5)


def test_unstated_or_nonsense_values_stay_unknown() -> None:
    shape = read_transformer_shape(_Model(rope_theta="big", rms_norm_eps=True), None)
    assert shape is not None and (shape.rope_theta, shape.norm_eps) == (None, None)
