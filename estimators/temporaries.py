"""Training-step temporaries outside forward + backward: the optimizer step's scratch tensors.

The activation fit (profile.py, ``ActivationFit``) is the peak of live bytes during forward, loss and
backward above the resident parameters, gradients and optimizer states. ``optimizer.step()`` runs after
backward, when the activations are gone but every gradient is still alive, and allocates scratch
tensors of its own. The step's peak is therefore

    states + max(activation peak, optimizer-step temporaries)

and never the sum of the two. This module sizes the optimizer-step temporaries of ``torch.optim.AdamW``
(= ``torch.optim.Adam`` with ``decoupled_weight_decay=True``, torch/optim/adamw.py) for each of its three
implementations, read off torch 2.13's torch/optim/adam.py:

* ``single_tensor`` (``_single_tensor_adam``; the default for CPU tensors, and ``foreach=False``): a
  Python loop over the parameters. Weight decay (``param.mul_``), ``exp_avg.lerp_`` and
  ``exp_avg_sq.mul_(beta2).addcmul_`` are in place; the only new tensors come from
  ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: while the quotient is being written
  the ``sqrt()`` result is still alive, and the previous parameter's ``denom`` is still bound to the loop
  variable until the assignment. Peak over the loop: ``max_i (2 n_i + n_{i-1}) * state_bytes``
  (n_i the numel of the i-th parameter that has a gradient, in ``param_groups`` order; n_{-1} = 0).
* ``foreach`` (``_multi_tensor_adam``; the default for CUDA tensors, torch/optim/optimizer.py
  ``_default_to_fused_or_foreach`` with ``torch.utils._foreach_utils._get_foreach_kernels_supported_devices``
  = cuda/xpu/mtia/privateuse1): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` allocates
  one tensor per parameter of the (device, dtype) group, all alive until ``_foreach_addcdiv_`` has used
  them: ``sum_i n_i * state_bytes`` for one group (AdamW's decoupled decay makes no gradient copy).
* ``fused`` (``torch._fused_adamw_``, ``fused=True``): updates in place, no parameter-sized temporaries.
  DeepSpeed's default for an ``"AdamW"``/``"Adam"`` optimizer section is its ``FusedAdam``
  (deepspeed/runtime/engine.py ``get_optimizer_configuration``: unless ``torch_adam`` is set or a CPU
  optimizer is used for offload), a ``multi_tensor_applier`` kernel that also updates in place.

Bytes are per optimizer ``param_group``: the scratch of one group is freed before the next group runs,
so with several groups take the largest. Adam's ``state["step"]`` counters are one 0-d float32 tensor
per parameter (``torch.tensor(0.0, dtype=_get_scalar_dtype())`` in ``Adam._init_group``), kept on the
CPU unless ``capturable`` or ``fused``: see :func:`adam_step_counter_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

AdamImpl = Literal["single_tensor", "foreach", "fused"]
DeviceKind = Literal["cpu", "cuda"]

STEP_COUNTER_BYTES = 4
"""One float32 0-d ``state["step"]`` tensor per parameter (bytes)."""


def default_adam_impl(device: DeviceKind) -> AdamImpl:
    """The implementation ``torch.optim.AdamW()`` picks with ``foreach=None, fused=None``: the
    single-tensor loop on CPU, foreach on CUDA (torch/optim/optimizer.py ``_default_to_fused_or_foreach``)."""
    return "foreach" if device == "cuda" else "single_tensor"


def engine_adam_impl(engine: str, device: DeviceKind = "cuda") -> AdamImpl:
    """The AdamW implementation a training engine runs by default: DeepSpeed's FusedAdam (``fused``;
    Megatron-Core likewise uses Transformer Engine's or apex's FusedAdam when installed), torch's own
    choice for plain torch (:func:`default_adam_impl`)."""
    if engine in ("deepspeed", "megatron") and device == "cuda":
        return "fused"
    return default_adam_impl(device)


def adamw_step_temp_bytes(param_numels: Sequence[int], impl: AdamImpl, state_bytes: int = 4) -> int:
    """Peak scratch bytes of one ``AdamW.step()`` over parameters of ``param_numels`` elements (one
    param group, in ``param_groups`` order, parameters without a gradient left out), with optimizer
    moments of ``state_bytes`` bytes per element (4 for fp32 moments). See the module docstring."""
    if state_bytes < 0 or any(n < 0 for n in param_numels):
        raise ValueError("element counts and state_bytes must be >= 0")
    if impl == "fused" or not param_numels:
        return 0
    if impl == "foreach":
        return sum(param_numels) * state_bytes
    if impl == "single_tensor":
        previous = 0
        peak = 0
        for n in param_numels:
            peak = max(peak, 2 * n + previous)
            previous = n
        return peak * state_bytes
    raise ValueError(f"unknown AdamW implementation {impl!r}")


def adam_step_counter_bytes(param_tensors: int, impl: AdamImpl, device: DeviceKind, *,
                            capturable: bool = False) -> int:
    """Bytes of Adam's ``state["step"]`` tensors on ``device`` for ``param_tensors`` parameters.

    They sit on the parameters' device only with ``capturable=True`` or the fused kernel; otherwise on
    the CPU, so they count on a CPU run and not on a GPU.
    """
    on_param_device = capturable or impl == "fused"
    if device == "cpu" or on_param_device:
        return param_tensors * STEP_COUNTER_BYTES
    return 0


def step_peak_bytes(states_bytes: int, activation_bytes: int, optimizer_temp_bytes: int) -> int:
    """Peak live bytes of a training step whose gradients stay allocated between steps: the resident
    states plus the larger of the forward/backward activation peak and the optimizer-step scratch."""
    return states_bytes + max(activation_bytes, optimizer_temp_bytes)


def optimizer_temp_excess_bytes(activation_bytes: int, optimizer_temp_bytes: int) -> int:
    """What the optimizer step adds on top of ``states + activations`` (bytes; 0 when the activation
    peak is the larger). Adding this as its own category keeps a breakdown's categories summing to
    the peak: ``states + activations + excess == step_peak_bytes(...)``."""
    return max(0, optimizer_temp_bytes - activation_bytes)
