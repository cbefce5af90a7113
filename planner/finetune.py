"""``--finetune full|lora|qlora`` and its flags, checked together: what to profile and how to hold the base.

- ``full``: every parameter trains (the default; the model as built).
- ``lora``: LoRA adapters (``--lora-rank``, default 16; ``--lora-alpha``, default 2·rank; ``--lora-targets``,
  default the linear layers of the repeated blocks; ``--lora-dropout``, default 0) on a frozen base held in 16 bits, or in 8 bits with
  ``--quant int8``; adapters in fp32 under bf16 autocast (``amp-bf16``, peft's default).
- ``qlora``: the same adapters on a 4-bit base (``--quant nf4-dq`` by default, QLoRA's NF4 with double
  quantisation; ``nf4`` without it, ``int8``); adapters in bf16 with bf16 AdamW moments (``bf16-pure``: what
  TRL's SFTTrainer makes of a quantised model's adapters, following QLoRA §3).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from optplan.estimators.errors import OptplanError
from optplan.estimators.finetune import (
    LORA_DEFAULT_RANK,
    QLORA_DEFAULT_QUANT,
    QUANT_NAMES,
    AdapterProfile,
    FinetuneMethod,
    LoraRequest,
    QuantName,
)
from optplan.estimators.strategy import Strategy

FINETUNE_METHODS: tuple[FinetuneMethod, ...] = ("full", "lora", "qlora")
LORA_PRECISIONS_BF16 = ("amp-bf16",)
LORA_PRECISIONS_NO_BF16 = ("amp-fp16",)
QLORA_PRECISIONS_BF16 = ("bf16-pure",)


class FinetuneChoice(BaseModel):
    """The fine-tuning flags as given (None: not given)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    finetune: str = "full"
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    quant: str | None = None

    @property
    def adapters(self) -> bool:
        return self.finetune in ("lora", "qlora")

    @classmethod
    def of_adapter(cls, adapter: AdapterProfile, quant: str) -> FinetuneChoice:
        """The flags that make a profile with ``adapter`` and plans with base ``quant`` again (``qlora`` for a
        quantised base)."""
        return cls(finetune="lora" if quant == "none" else "qlora", lora_rank=adapter.rank, lora_alpha=adapter.alpha,
                   lora_targets=",".join(adapter.targets), lora_dropout=adapter.dropout, quant=quant)

    def check(self, *, runs_a_model: bool) -> None:
        """One OptplanError line per inconsistent flag, before anything is profiled."""
        if self.finetune not in FINETUNE_METHODS:
            raise OptplanError(f"unknown --finetune {self.finetune!r}: use one of {', '.join(FINETUNE_METHODS)}")
        if self.quant is not None and self.quant not in QUANT_NAMES:
            raise OptplanError(f"unknown --quant {self.quant!r}: use one of {', '.join(QUANT_NAMES)}")
        if not self.adapters:
            given = [flag for flag, v in (("--lora-rank", self.lora_rank), ("--lora-alpha", self.lora_alpha),
                                          ("--lora-targets", self.lora_targets), ("--lora-dropout", self.lora_dropout),
                                          ("--quant", self.quant)) if v is not None]
            if given:
                verb = "applies" if len(given) == 1 else "apply"
                raise OptplanError(f"{', '.join(given)} {verb} to LoRA fine-tuning: add --finetune lora (or qlora), "
                                   f"or drop {' and '.join(given)}")
            return
        if not runs_a_model:
            raise OptplanError(f"--finetune {self.finetune} adds adapters to a real model: give a model FILE or --hf "
                               "(not --arch/--params)")
        if self.lora_rank is not None and self.lora_rank < 1:
            raise OptplanError(f"--lora-rank must be >= 1 (got {self.lora_rank})")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise OptplanError(f"--lora-alpha must be > 0 (got {self.lora_alpha:g})")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise OptplanError(f"--lora-dropout is a probability: give 0 <= p < 1, e.g. 0.05 (got {self.lora_dropout:g})")
        if self.lora_targets is not None and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise OptplanError("--lora-targets is empty: name the layers, e.g. q_proj,v_proj")
        if self.finetune == "qlora" and self.quant == "none":
            raise OptplanError("--finetune qlora quantises the base: use --quant nf4-dq, nf4 or int8, or --finetune lora")

    def check_engines(self, engines: Sequence[str] | None) -> None:
        """recommend's ``--engine``: a LoRA/QLoRA plan runs on the torch engine (finetune.py: TRL's SFTTrainer
        under DDP or FSDP), so engines without torch are one error line rather than a silent torch plan."""
        if self.adapters and engines and "torch" not in engines:
            raise OptplanError(f"--finetune {self.finetune} plans run on the torch engine (finetune.py, TRL's "
                               f"SFTTrainer with DDP or FSDP), and --engine names {', '.join(engines)}: "
                               "drop --engine (or use --engine torch)")

    def check_strategy(self, strategy: Strategy) -> None:
        """estimate's flags for a LoRA/QLoRA plan: what finetune.py runs and the search plans (torch engine, data
        parallel or FSDP, no tensor/pipeline/context/expert parallelism, no offload); anything else is one error
        line naming the flag, not a number for a layout no export can start."""
        if not self.adapters:
            return
        method = f"--finetune {self.finetune}"
        if strategy.engine != "torch":
            flag = "--zero" if strategy.engine == "deepspeed" and strategy.zero else "--engine"
            raise OptplanError(f"{method} plans run on the torch engine (finetune.py, TRL's SFTTrainer), not "
                               f"{strategy.engine}: drop {flag} (shard with --fsdp full or grad_op instead)")
        split = [f"--{k} {v}" for k, v in (("tp", strategy.tp), ("pp", strategy.pp), ("cp", strategy.cp),
                                            ("ep", strategy.ep)) if v > 1]
        if split:
            raise OptplanError(f"{method} with {', '.join(split)}: LoRA plans are data parallel or FSDP only "
                               f"(model parallelism with adapters is not modelled): drop {split[0].split()[0]}")
        if strategy.offload_optimizer != "none" or strategy.offload_params != "none":
            raise OptplanError(f"{method} with offload: LoRA plans keep everything on the GPU (the optimizer "
                               "states are the adapters'): drop the offload flags")

    def lora_request(self) -> LoraRequest | None:
        """What the profile builds: the adapters, or None for full training."""
        if not self.adapters:
            return None
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip()) if self.lora_targets else None
        return LoraRequest(rank=self.lora_rank or LORA_DEFAULT_RANK, alpha=self.lora_alpha, targets=targets,
                           dropout=self.lora_dropout or 0.0)

    def quant_name(self) -> QuantName:
        """How the frozen base is held: --quant, else NF4 with double quantisation for qlora, else 16-bit."""
        if self.quant is not None:
            return self.quant  # type: ignore[return-value]
        return QLORA_DEFAULT_QUANT if self.finetune == "qlora" else "none"

    def precisions(self, supports_bf16: bool) -> tuple[str, ...] | None:
        """The recipes searched when --precision is not given (None: the full-training defaults)."""
        if not self.adapters:
            return None
        if not supports_bf16:
            return LORA_PRECISIONS_NO_BF16
        return QLORA_PRECISIONS_BF16 if self.finetune == "qlora" else LORA_PRECISIONS_BF16
