"""``recommend``'s options as given, and the one-line checks of single flags; shared by ``optplan recommend``
and ``optplan dashboard`` (``recommend_run`` checks them together and runs the pipeline).

Cheap to import (pydantic only): the CLI imports it at startup.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import get_args

from pydantic import ConfigDict

from optplan.estimators.errors import OptplanError
from optplan.estimators.strategy import ReduceDtype
from optplan.planner.finetune import FinetuneChoice

PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw-8bit", "adafactor", "sgd", "paged_adamw", "paged_adamw8bit",
              "paged_adamw_32bit", "paged_adamw_8bit")
ENGINES = ("deepspeed", "torch", "megatron")
METHODS = ("auto", "enumerate", "screen", "nsga2", "tpe")
LAUNCHERS = ("torchrun", "deepspeed")
REDUCE_DTYPES: tuple[str, ...] = get_args(ReduceDtype)
"""``--fsdp-reduce-dtype``'s values (``Strategy.fsdp_reduce_dtype``)."""


FLAG_EXAMPLES: dict[str, str] = {"params": "7e9", "tokens": "1e11", "compute": "1e23", "global-batch-tokens": "4e6",
                                 "price": "2.5", "probe-budget": "120", "probe-timeout": "300", "timeout": "600"}
"""A value each numeric flag takes, for the fix its error names."""


def check_finite(flag: str, value: float | None, *, allow_zero: bool = False) -> None:
    """One line when a numeric flag is NaN, infinite, negative or (unless allowed) zero, with a value it takes."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        example = f": e.g. --{flag} {FLAG_EXAMPLES[flag]}" if flag in FLAG_EXAMPLES else ""
        raise OptplanError(f"--{flag} must be {need} (got {value:g}){example}")


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """One line naming the flag, the bad value and the choices."""
    if value not in choices:
        raise OptplanError(f"unknown {flag} {value!r}: use one of {', '.join(choices)}")


def parse_duration_s(text: str, flag: str = "--deadline") -> float:
    """'30d', '720h', '90m' or a plain number of days -> seconds."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    t = text.strip().lower()
    scale = units.get(t[-1:], None)
    number = t[:-1] if scale is not None else t
    try:
        value = float(number) * (scale if scale is not None else 86400.0)
    except ValueError:
        raise OptplanError(f"{flag} {text!r} is not a duration: use e.g. 30d, 720h or 45 (days)") from None
    if not math.isfinite(value) or value <= 0:
        raise OptplanError(f"{flag} must be a positive duration (got {text!r})")
    return value


class RecommendArgs(FinetuneChoice):
    """The options of ``optplan recommend`` (and ``dashboard``) as given, before any check; the fine-tuning flags
    (``--finetune``, ``--lora-*``, ``--quant``) are :class:`~optplan.planner.finetune.FinetuneChoice`'s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path | None = None
    hf: str | None = None
    hf_class: str | None = None
    arch: str | None = None
    params: float | None = None
    gpu: str | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    cluster: Path | None = None
    gpus_range: str | None = None
    global_batch: int | None = None
    global_batch_tokens: float | None = None
    seq_len: int | None = None
    precision: tuple[str, ...] | None = None
    checkpointing: tuple[str, ...] | None = None
    optimizer: tuple[str, ...] | None = None
    engine: tuple[str, ...] | None = None
    offload: bool = True
    compile_: bool = False
    fsdp_reduce_dtype: str = "auto"
    objective: str = "throughput"
    tokens: float | None = None
    price: float | None = None
    deadline: str | None = None
    method: str = "auto"
    trials: int | None = None
    seed: int = 0
    storage: str | None = None
    out: Path | None = None
    launcher: str = "torchrun"
    force: bool = False
    probe: bool | None = None
    probe_budget: float = 600.0
    probe_timeout: float = 300.0
    probe_top_k: int = 4
    probe_steps: int = 5
    probe_nproc: int | None = None
    calibration: bool = True
    model_name: str | None = None

    @property
    def runs_a_model(self) -> bool:
        """A model that runs for real (a model file, or the one ``--hf`` writes), not a formula shape."""
        return self.model is not None or self.hf is not None
