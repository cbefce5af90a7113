"""Sparse embedding gradients: planned with SGD (AdamW raises on them), a named dense optimizer refused, and the
census counting them."""

from __future__ import annotations

import pytest
import torch.nn as nn
from conftest import make_gpu, make_profile

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.planner.derive import StrategyFlags, derive_strategy, file_defaults
from optplan.planner.space import build_space
from optplan.planner.sparse_grads import check_sparse_optimizers
from optplan.probes.model_census import sparse_grad_params

CLUSTER = Cluster(gpu=make_gpu(), gpus=1, gpus_per_node=1)


def test_the_census_counts_sparse_embeddings_once() -> None:
    shared = nn.Embedding(100, 8, sparse=True)
    model = nn.ModuleDict({"a": shared, "b": shared, "bag": nn.EmbeddingBag(50, 8, sparse=True),
                           "dense": nn.Embedding(10, 8), "frozen": nn.Embedding(7, 8, sparse=True)})
    model["frozen"].weight.requires_grad_(False)
    assert sparse_grad_params(model) == 100 * 8 + 50 * 8


def test_sparse_models_are_planned_with_sgd_and_dense_optimizers_refused() -> None:
    sparse = make_profile().model_copy(update={"sparse_grad_params": 1000})
    dense = make_profile()
    assert check_sparse_optimizers(dense, ("adamw",), named=False) == ("adamw",)
    assert check_sparse_optimizers(sparse, ("adamw",), named=False) == ("sgd",)
    assert check_sparse_optimizers(sparse, ("sgd",), named=True) == ("sgd",)
    with pytest.raises(OptplanError, match="adamw cannot step .* sparse gradients .* use --optimizer sgd"):
        check_sparse_optimizers(sparse, ("adamw", "sgd"), named=True)
    space = build_space(sparse, CLUSTER, global_batch=8)
    assert space.optimizers == ("sgd",)
    with pytest.raises(OptplanError, match="use --optimizer sgd"):
        build_space(sparse, CLUSTER, global_batch=8, optimizers=["adamw"])
    # estimate: the default becomes SGD, a named AdamW is refused
    flags = StrategyFlags(precision="fp32", mbs=1)
    strategy = derive_strategy(flags, CLUSTER, gpus_given=True)
    updates, _ = file_defaults(sparse, CLUSTER, flags, strategy, precision_given=True)
    assert updates["optimizer"] == "sgd"
    named = flags.model_copy(update={"optimizer": "adamw"})
    with pytest.raises(OptplanError, match="adamw cannot step"):
        file_defaults(sparse, CLUSTER, named, derive_strategy(named, CLUSTER, gpus_given=True), precision_given=True)
