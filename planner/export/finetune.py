"""LoRA / QLoRA exports: ``finetune.json`` (peft ``LoraConfig``, transformers ``BitsAndBytesConfig``, TRL
``SFTConfig`` keyword arguments) and ``finetune.py`` (the launch script that builds them and trains with TRL's
``SFTTrainer``), each checked by building the real objects.

The mapping (peft 0.21, transformers 5.24, TRL 1.16):
- ``lora``: ``LoraConfig(r, lora_alpha, target_modules, lora_dropout=0, bias="none", task_type="CAUSAL_LM")``, the
  adapters the profile was built with.
- ``bnb``: the quantised base (QLoRA §3, transformers' bitsandbytes integration): ``nf4``/``nf4-dq`` ->
  ``load_in_4bit`` with ``bnb_4bit_quant_type="nf4"``, ``bnb_4bit_use_double_quant`` for ``nf4-dq`` and the bf16
  compute dtype; ``int8`` -> ``load_in_8bit``. Under FSDP, ``bnb_4bit_quant_storage=bfloat16`` (FSDP flattens
  the packed weights with the others: transformers' FSDP-QLoRA guide).
- ``model``: ``from_pretrained`` of the --hf config's folder (where the weights go) in the recipe's 16-bit dtype.
- ``sft``: batch and accumulation of the plan, ``bf16``/``fp16`` (autocast: ``amp-bf16`` keeps fp32 adapters, peft's
  ``autocast_adapter_dtype`` default; a quantised model's adapters are cast to bf16 by SFTTrainer, QLoRA §3:
  the plan's ``bf16-pure``), ``activation_checkpointing`` (transformers 5's name for ``gradient_checkpointing``) as
  planned (SFTConfig's default is on) with
  non-reentrant checkpointing (what the profile measured), ``optim``, ``max_length`` = the plan's sequence length,
  FSDP2 (``fsdp``/``fsdp_config``, as the hf export writes them) for sharded plans.

Refused (``NotExportable``, one line): plans without adapters (train.py trains every parameter), engines other
than torch, hybrid FSDP, a quantised base under an AMP recipe (SFTTrainer casts its adapters to bf16: plan
``--precision bf16-pure``), LoRA on a 16-bit base under ``bf16-pure`` (SFTTrainer keeps those adapters fp32),
and models that did not come from ``--hf`` (``from_pretrained`` needs a Hugging Face model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from optplan.planner.export.context import ExportPlan, NotExportable
from optplan.planner.export.hf import FSDP_RESHARD, OPTIM_NAMES

FINETUNE_JSON = "finetune.json"
FINETUNE_PY = "finetune.py"
QLORA_LEARNING_RATE = 2e-4
"""QLoRA's learning rate for 7B-13B models (arXiv 2305.14314, Appendix B.2 / Table 9)."""
_DTYPES = {"amp-bf16": "bfloat16", "bf16-pure": "bfloat16", "bf16": "bfloat16", "amp-fp16": "float16",
           "fp16": "float16", "fp32": "float32"}


def hf_model_folder(model_path: str) -> str | None:
    """The folder of the config an ``--hf`` model file was generated from (None for other model files)."""
    from optplan.planner.hf_source import generated_model_file

    generated = generated_model_file(model_path) if model_path else None
    if generated is None:
        return None
    match = re.search(r"^CONFIG_PATH = (['\"])(.+?)\1$", generated[1], re.MULTILINE)
    return str(Path(match.group(2)).parent) if match else None


def _check_exportable(plan: ExportPlan) -> str:
    s, adapter = plan.strategy, plan.adapter
    if adapter is None:
        raise NotExportable("this plan trains every parameter: finetune.py is for --finetune lora|qlora plans (use "
                            "train.py)")
    if s.engine != "torch":
        raise NotExportable(f"finetune.py runs TRL's SFTTrainer on the torch engine, and this plan runs on {s.engine}: "
                            "plan with --engine torch")
    if s.fsdp == "hybrid":
        raise NotExportable("hybrid FSDP needs an accelerate ParallelismConfig, which SFTConfig cannot carry: plan "
                            "with --fsdp full")
    if s.fsdp != "none" and not plan.block_class:
        raise NotExportable("FSDP wraps the repeated block class and the profile names none: plan without --fsdp")
    if s.quant != "none" and s.precision != "bf16-pure":
        raise NotExportable(f"SFTTrainer casts a quantised model's adapters to bf16, and this plan keeps them "
                            f"{s.precision}: plan with --precision bf16-pure")
    if s.quant == "none" and s.precision in ("bf16-pure", "bf16", "fp16"):
        raise NotExportable("SFTTrainer keeps the adapters of a 16-bit base in fp32 (peft's autocast_adapter_dtype): "
                            "plan with --precision amp-bf16")
    if s.precision == "fp8":
        raise NotExportable("SFTConfig has no fp8 switch: plan with --precision amp-bf16")
    folder = hf_model_folder(plan.model_path)
    if folder is None:
        raise NotExportable("finetune.py loads the weights with from_pretrained, which needs a Hugging Face model: "
                            "plan with --hf CONFIG_OR_ID")
    return folder


def finetune_config(plan: ExportPlan) -> dict[str, Any]:
    """The ``finetune.json`` document for ``plan`` (a fresh JSON-serialisable dict); NotExportable when the
    plan cannot be launched this way (module docstring)."""
    folder = _check_exportable(plan)
    s, adapter = plan.strategy, plan.adapter
    assert adapter is not None
    lora = {"r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": 0.0, "bias": "none",
            "target_modules": list(adapter.targets), "task_type": "CAUSAL_LM"}
    bnb: dict[str, Any] | None = None
    if s.quant == "int8":
        bnb = {"load_in_8bit": True}
    elif s.quant in ("nf4", "nf4-dq"):
        bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": s.quant == "nf4-dq",
               "bnb_4bit_compute_dtype": "bfloat16"}
        if s.fsdp != "none":
            bnb["bnb_4bit_quant_storage"] = "bfloat16"
    sft: dict[str, Any] = {
        "output_dir": "out", "per_device_train_batch_size": s.mbs, "gradient_accumulation_steps": s.grad_accum,
        "bf16": s.precision in ("amp-bf16", "bf16-pure"), "fp16": s.precision == "amp-fp16",
        "optim": OPTIM_NAMES[s.optimizer], "learning_rate": QLORA_LEARNING_RATE, "report_to": "none",
        "activation_checkpointing": s.checkpointing == "full" and s.fsdp == "none",
    }
    if sft["activation_checkpointing"]:
        sft["activation_checkpointing_kwargs"] = {"use_reentrant": False}
    if plan.seq_len:
        sft["max_length"] = plan.seq_len
    if s.fsdp != "none":
        sft["fsdp"] = "full_shard auto_wrap" if s.fsdp == "full" else "shard_grad_op auto_wrap"
        sft["fsdp_config"] = {"version": 2, "reshard_after_forward": FSDP_RESHARD[s.fsdp],
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "transformer_layer_cls_to_wrap": [plan.block_class],
                              "activation_checkpointing": s.checkpointing == "full"}
    elif plan.world_size > 1:
        sft["ddp_find_unused_parameters"] = False
    return {"plan": s.label(), "model": {"name_or_path": folder, "dtype": _DTYPES.get(s.precision, "bfloat16")},
            "lora": lora, "bnb": bnb, "sft": sft}


def render_finetune_json(plan: ExportPlan) -> str:
    return json.dumps(finetune_config(plan), indent=2) + "\n"


SCRIPT = '''"""Generated by optplan: a LoRA fine-tune that applies the plan in finetune.json ({label}).

    torchrun --nproc-per-node {procs} finetune.py --dataset DATA   (or: python finetune.py --dataset DATA)

DATA is a datasets hub name or a local .json/.jsonl/.csv/.parquet file with a "text" column (or chat
"messages"), as TRL's SFTTrainer takes it. Needs torch, transformers, peft, trl, datasets{bnb_need}; not optplan.
"""

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCAL_FORMATS = {{".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}}


def main():
    parser = argparse.ArgumentParser(description="LoRA fine-tune with the optplan plan in finetune.json")
    parser.add_argument("--dataset", required=True, help="datasets hub name or a local json/jsonl/csv/parquet file")
    parser.add_argument("--model", default=None, help="model folder or hub id (default: finetune.json's)")
    parser.add_argument("--config", default=str(HERE / "finetune.json"))
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test of the script)")
    args = parser.parse_args()
    cfg = json.loads(Path(args.config).read_text(encoding="utf-8"))

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    kwargs = {{"dtype": getattr(torch, cfg["model"]["dtype"])}}
    if cfg["bnb"]:
        bnb = {{k: getattr(torch, v) if k.endswith("_dtype") or k.endswith("_storage") else v
               for k, v in cfg["bnb"].items()}}
        kwargs["quantization_config"] = BitsAndBytesConfig(**bnb)
    model = AutoModelForCausalLM.from_pretrained(args.model or cfg["model"]["name_or_path"], **kwargs)
    path = Path(args.dataset)
    if path.suffix in LOCAL_FORMATS and path.is_file():
        data = load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    else:
        data = load_dataset(args.dataset, split="train")
    trainer = SFTTrainer(model=model, args=SFTConfig(**cfg["sft"], max_steps=args.max_steps, use_cpu=args.cpu), train_dataset=data,
                         peft_config=LoraConfig(**cfg["lora"]))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
'''


def render_finetune_py(plan: ExportPlan) -> str:
    _check_exportable(plan)
    return SCRIPT.format(label=plan.strategy.label(), procs=plan.procs_per_node,
                         bnb_need=", bitsandbytes" if plan.strategy.quant != "none" else "")


def validate_finetune(config_text: str, script_text: str, plan: ExportPlan) -> None:
    """Build peft's ``LoraConfig``, transformers' ``BitsAndBytesConfig`` and TRL's ``SFTConfig`` (transformers'
    ``TrainingArguments`` when TRL is not installed) from ``finetune.json`` and check them against the plan; compile
    ``finetune.py``. ExportValidationError (one line) on any mismatch."""
    from optplan.planner.validate import ExportValidationError

    try:
        compile(script_text, FINETUNE_PY, "exec", dont_inherit=True)
        cfg = json.loads(config_text)
    except (SyntaxError, ValueError) as exc:
        raise ExportValidationError(f"the finetune export does not parse: {exc}") from exc
    s, adapter = plan.strategy, plan.adapter
    assert adapter is not None
    try:
        import torch
        from peft import LoraConfig
        from transformers import BitsAndBytesConfig, TrainingArguments
    except ImportError as exc:
        raise ExportValidationError(f"cannot import {exc.name} to check finetune.json: pip install peft "
                                    "transformers") from exc
    try:
        lora = LoraConfig(**cfg["lora"])
    except Exception as exc:
        raise ExportValidationError(f"peft LoraConfig rejects finetune.json: {exc}") from exc
    if (lora.r, lora.lora_alpha, set(lora.target_modules)) != (adapter.rank, adapter.alpha, set(adapter.targets)):
        raise ExportValidationError("finetune.json's LoRA rank, alpha or targets differ from the plan's: re-export")
    if cfg["bnb"]:
        kwargs = {k: getattr(torch, v) if k.endswith(("_dtype", "_storage")) else v for k, v in cfg["bnb"].items()}
        try:
            bnb = BitsAndBytesConfig(**kwargs)
        except Exception as exc:
            raise ExportValidationError(f"BitsAndBytesConfig rejects finetune.json: {exc}") from exc
        want = {"int8": (True, False), "nf4": (False, True), "nf4-dq": (False, True)}[s.quant]
        if (bnb.load_in_8bit, bnb.load_in_4bit) != want or (
                bnb.load_in_4bit and bnb.bnb_4bit_use_double_quant != (s.quant == "nf4-dq")):
            raise ExportValidationError(f"finetune.json's quantisation is not the plan's {s.quant}: re-export")
    elif s.quant != "none":
        raise ExportValidationError(f"finetune.json has no quantisation for the plan's {s.quant} base: re-export")
    try:
        from trl import SFTConfig as ArgsClass
    except ImportError:  # check the TrainingArguments part only
        ArgsClass = TrainingArguments
        sft = {k: v for k, v in cfg["sft"].items() if k not in ("max_length",)}
    else:
        sft = dict(cfg["sft"])
    try:
        args = ArgsClass(**sft, use_cpu=True)
    except Exception as exc:
        raise ExportValidationError(f"{ArgsClass.__name__} rejects finetune.json: {exc}") from exc
    checkpointing = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing",
                                                                                    False))
    got = (args.per_device_train_batch_size, args.gradient_accumulation_steps, bool(args.bf16), checkpointing)
    want_args = (s.mbs, s.grad_accum, s.precision in ("amp-bf16", "bf16-pure"),
                 s.checkpointing == "full" and s.fsdp == "none")
    if got != want_args:
        raise ExportValidationError(f"{ArgsClass.__name__} from finetune.json has (mbs, accumulation, bf16, "
                                    f"checkpointing) {got}, the plan {want_args}: re-export")
