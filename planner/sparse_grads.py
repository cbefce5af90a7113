"""Sparse gradients (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``) and the optimizers that take them.

torch's AdamW (and Adam, Adafactor, bitsandbytes' 8-bit and paged optimizers) raise on a sparse gradient ("Adam
does not support sparse gradients, please consider SparseAdam"); ``torch.optim.SGD`` takes them (the torch.optim
documentation's table of sparse support). A model with sparse embeddings is planned with SGD, and a dense optimizer
named for it is one error line, not a plan whose first optimizer step fails. Sparse gradients are priced as dense
(an upper bound on their bytes: a sparse gradient holds only the rows a batch looked up).
"""

from __future__ import annotations

from collections.abc import Sequence

from optplan.estimators.errors import OptplanError
from optplan.estimators.profile import ModelProfile

SPARSE_OPTIMIZERS: tuple[str, ...] = ("sgd",)
"""optplan's optimizers that take sparse gradients."""


def check_sparse_optimizers(profile: ModelProfile, optimizers: Sequence[str], *, named: bool) -> tuple[str, ...]:
    """The optimizers to plan ``profile`` with: ``optimizers`` as they are for a model without sparse gradients;
    SGD in place of the default for one with them (``named`` False); a named optimizer that refuses sparse
    gradients is an OptplanError naming the fix."""
    if not profile.sparse_grad_params:
        return tuple(optimizers)
    dense = [o for o in optimizers if o not in SPARSE_OPTIMIZERS]
    if not dense:
        return tuple(optimizers)
    if named:
        raise OptplanError(f"{', '.join(dense)} cannot step {profile.name}'s sparse gradients "
                           f"({profile.sparse_grad_params:,} parameters of an Embedding/EmbeddingBag with sparse=True; "
                           "torch raises at the first step): use --optimizer sgd, or build the embeddings with "
                           "sparse=False")
    return SPARSE_OPTIMIZERS


__all__ = ["SPARSE_OPTIMIZERS", "check_sparse_optimizers"]
