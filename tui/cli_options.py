"""The command line's shared option types (typer ``Annotated`` aliases), one definition per flag so that every
command spells and explains it the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from optplan.estimators.compiled_loss import compiled_loss_saving_bytes_per_logit


def out_folder(value: str) -> Path:
    """``--out``'s folder; an empty name (an unset shell variable, ``--out "$DIR"``) is refused rather than read as the
    working folder, where it would scatter the exports and the study."""
    if not value.strip():
        raise typer.BadParameter("is empty: name the folder to write to (--out . for the working folder)")
    return Path(value)


OptModelFile = Annotated[Path | None, typer.Argument(help="the model file (or give --hf or --arch instead)",
                                                     show_default=False)]
HfOpt = Annotated[str | None, typer.Option(
    "--hf", help="a Hugging Face model instead of a file: a config.json, a model folder or a hub id in the local cache (never downloaded)")]
HfClassOpt = Annotated[str | None, typer.Option("--hf-class", help="the transformers class for --hf (default: the config's architectures[0])")]
ArchOpt = Annotated[str | None, typer.Option(
    "--arch", help="a decoder by shape instead of a file: layers=L,hidden=H,heads=A[,kv_heads=K][,ffn=F][,vocab=V][,seq=S][,gated=1][,tied=0]")]
FinetuneOpt = Annotated[str, typer.Option("--finetune", help="full (every parameter trains), lora (adapters on a 16-bit base) or qlora (adapters on a 4-bit NF4 base)")]
LoraRankOpt = Annotated[int | None, typer.Option("--lora-rank", help="LoRA rank r (default 16)")]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha (default 2 x rank)")]
LoraDropoutOpt = Annotated[float | None, typer.Option("--lora-dropout", help="peft lora_dropout of the adapters, 0 <= p < 1 (default 0; a dropout keeps a mask and a dropped copy of each adapted layer's input)")]
LoraTargetsOpt = Annotated[str | None, typer.Option("--lora-targets", help="comma-separated layer names to adapt (default: the linear layers of the repeated blocks, e.g. q_proj,...,down_proj)")]
QuantOpt = Annotated[str | None, typer.Option("--quant", help="frozen base of a LoRA run: none, int8, nf4 or nf4-dq (default: nf4-dq for qlora, none for lora)")]
GpuOpt = Annotated[str | None, typer.Option("--gpu", help="GPU to plan for (default: detected, else H100-SXM)")]
GpusOpt = Annotated[int | None, typer.Option("--gpus", help="number of GPUs (default: detected, else 8)")]
GpnOpt = Annotated[int | None, typer.Option("--gpus-per-node", help="GPUs per node (default: min(gpus, 8))")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="sequence length (default: OPTPLAN or model max)")]
PlanSeqOpt = Annotated[int | None, typer.Option("--seq-len", help="sequence length (default: the plan.json's)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print a stable JSON document instead of tables")]
NameOpt = Annotated[str | None, typer.Option("--model-name", help="which model when the file defines several")]
COMPILE_HELP = ("torch.compile each repeated block (torch and deepspeed engines): Inductor fuses the elementwise "
                "ops between GEMMs, priced as fused kernels (eager plans are priced by the measured per-operator "
                "bytes); the exports compile too, and the model file's loss_fn with them (estimate --eager-loss "
                "keeps it eager)")
FSDP_REDUCE_DTYPE_HELP = ("the dtype torch FSDP reduce-scatters gradients in: auto (fp32, bf16 under bf16-pure: "
                          "torchtitan's and optplan's train.py), fp32, or the recipe's 16-bit dtype (bf16, fp16: "
                          "what accelerate, the Hugging Face Trainer and Lightning run by default; half the bytes)")
COMPILE_LOSS_HELP = ("torch.compile of the model file's loss_fn (default: with --compile, as torchtitan does): "
                     "Inductor's fused cross entropy holds the logits and their gradient only, where an eager one "
                     f"keeps fp32 copies ({compiled_loss_saving_bytes_per_logit('bf16')} bytes less per 16-bit logit, "
                     f"{compiled_loss_saving_bytes_per_logit('fp32')} per fp32 one); --eager-loss compiles the blocks "
                     "only")
ClusterOpt = Annotated[Path | None, typer.Option("--cluster", help="cluster YAML: gpu, gpus_per_node, nodes[, bandwidths, price, power]")]
