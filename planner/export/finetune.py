"""Fine-tuning exports for Hugging Face models: ``finetune.json`` (peft ``LoraConfig``, transformers
``BitsAndBytesConfig`` and ``DistributedConfig``, TRL ``SFTConfig`` keyword arguments) and ``finetune.py`` (the
launch script that builds them and trains with TRL's ``SFTTrainer``), each checked by building the real objects.
LoRA/QLoRA plans and full fine-tuning plans (``--finetune full``, or any full-training plan of an ``--hf`` model).

The mapping (peft 0.21, transformers 5.24, TRL 1.16):
- ``lora``: ``LoraConfig(r, lora_alpha, target_modules, lora_dropout (the profiled --lora-dropout), bias="none", task_type="CAUSAL_LM")``, the
  adapters the profile was built with.
- ``bnb``: the quantised base (QLoRA §3, transformers' bitsandbytes integration): ``nf4``/``nf4-dq`` ->
  ``load_in_4bit`` with ``bnb_4bit_quant_type="nf4"``, ``bnb_4bit_use_double_quant`` for ``nf4-dq`` and the bf16
  compute dtype; ``int8`` -> ``load_in_8bit``. Under FSDP, ``bnb_4bit_quant_storage=bfloat16`` (FSDP flattens
  the packed weights with the others: transformers' FSDP-QLoRA guide).
- ``model``: ``from_pretrained`` of the --hf config's folder (where the weights go) in the recipe's dtype (a
  full fine-tune loads fp32 weights under the AMP and ``bf16`` recipes, which keep fp32 masters, and bf16
  weights under ``bf16-pure``).
- ``distributed_config``: tensor parallelism by the model's own tp_plan (estimators/tensor_plan.py), loaded
  sharded by transformers 5 (``from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size,
  dp_replicate_size, fsdp_mixed_precision, fsdp_cpu_offload))``, ``transformers/distributed``): FSDP2 FULL_SHARD
  over the data-parallel ranks (HSDP: one replica per node), bf16 compute over fp32 shards for the ``bf16`` and
  ``amp-bf16`` recipes; the Trainer then leaves the model's placement alone and sets accelerate's
  ``ParallelismConfig(tp_size, dp_shard_size)`` from it (``trainer.py``).
- ``sft``: batch and accumulation of the plan, ``bf16``/``fp16`` (autocast: ``amp-bf16`` keeps fp32 adapters, peft's
  ``autocast_adapter_dtype`` default; a quantised model's adapters are cast to bf16 by SFTTrainer, QLoRA §3:
  the plan's ``bf16-pure``), ``activation_checkpointing`` (transformers 5's name for ``gradient_checkpointing``,
  which older releases such as 5.17 need: the installed TrainingArguments decides, hf.py ``checkpointing_field``) as
  planned (SFTConfig's default is on) with
  non-reentrant checkpointing (what the profile measured), ``optim``, ``max_length`` = the plan's sequence length,
  FSDP2 (``fsdp``/``fsdp_config``, as the hf export writes them) for sharded plans.

Refused (``NotExportable``, one line): engines other than torch, hybrid FSDP without tensor parallelism, pipeline
or context parallelism, tensor parallelism beside SHARD_GRAD_OP or DDP (DistributedConfig has neither), fp8, a
quantised base under an AMP recipe (SFTTrainer casts its adapters to bf16: plan ``--precision bf16-pure``), LoRA on
a 16-bit base under ``bf16-pure`` (SFTTrainer keeps those adapters fp32), and models that did not come from ``--hf``
(``from_pretrained`` needs a Hugging Face model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from optplan.planner.export.context import FILE_NAMES, ExportPlan, NotExportable
from optplan.planner.export.hf import FSDP_RESHARD, OPTIM_NAMES, checkpointing_field, fsdp_accumulation_args

FINETUNE_JSON = "finetune.json"
FINETUNE_PY = "finetune.py"
QLORA_LEARNING_RATE = 2e-4
"""QLoRA's learning rate for 7B-13B models (arXiv 2305.14314, Appendix B.2 / Table 9)."""
DS_CONFIG_NAME = FILE_NAMES["deepspeed"]
"""The DeepSpeed config a deepspeed-engine plan's ``sft.deepspeed`` names, beside finetune.py (written with it)."""
FULL_LEARNING_RATE = 2e-5
"""A full fine-tune's learning rate (stated default: Alpaca's full fine-tune of LLaMA-7B, Taori et al. 2023)."""
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
    _require_hf(plan)  # first: no other setting makes a plain model file loadable by from_pretrained
    if s.engine == "megatron":
        raise NotExportable("finetune.py runs TRL's SFTTrainer, which cannot launch Megatron-LM: plan with --engine "
                            "torch or deepspeed")
    if s.engine != "torch" and adapter is not None:
        raise NotExportable(f"finetune.py runs LoRA plans on the torch engine, and this plan runs on {s.engine}: "
                            "plan with --engine torch")
    if s.pp > 1 or s.cp > 1:
        raise NotExportable("finetune.py runs tensor and data parallelism, and this plan splits the "
                            f"{'pipeline' if s.pp > 1 else 'sequence'}: plan with --pp 1 --cp 1")
    if s.tp > 1:
        if adapter is not None:
            raise NotExportable("finetune.py runs LoRA without tensor parallelism: plan with --tp 1")
        if s.dp > 1 and s.fsdp not in ("full", "hybrid"):
            raise NotExportable("transformers' DistributedConfig shards the data-parallel ranks of a tensor-parallel "
                                "model with FSDP2 FULL_SHARD only: plan with --fsdp full")
        if s.dp == 1 and s.fsdp != "none":
            raise NotExportable("with dp 1 there is nothing for FSDP to shard beside tensor parallelism: plan with "
                                "--fsdp none")
    elif s.fsdp == "hybrid":
        raise NotExportable("hybrid FSDP needs an accelerate ParallelismConfig, which SFTConfig cannot carry: plan "
                            "with --fsdp full")
    if s.fsdp != "none" and s.tp == 1 and not plan.block_class:
        raise NotExportable("FSDP wraps the repeated block class and the profile names none: plan without --fsdp")
    if s.precision == "fp8":
        raise NotExportable("SFTConfig has no fp8 switch: plan with --precision amp-bf16")
    if adapter is None:
        if s.tp == 1:
            from optplan.planner.export.hf import hf_training_args

            hf_training_args(plan)  # NotExportable for what TrainingArguments cannot express (its message)
        elif s.precision == "fp16":
            raise NotExportable("SFTConfig's fp16 switch is autocast over fp32 weights: plan with --precision "
                                "amp-fp16")
        return _hf_folder(plan)
    if s.quant != "none" and s.precision != "bf16-pure":
        raise NotExportable(f"SFTTrainer casts a quantised model's adapters to bf16, and this plan keeps them "
                            f"{s.precision}: plan with --precision bf16-pure")
    if s.quant == "none" and s.precision in ("bf16-pure", "bf16", "fp16"):
        raise NotExportable("SFTTrainer keeps the adapters of a 16-bit base in fp32 (peft's autocast_adapter_dtype): "
                            "plan with --precision amp-bf16")
    return _hf_folder(plan)


CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _require_hf(plan: ExportPlan) -> str:
    """The Hugging Face folder the plan's model file was generated from; NotExportable for a plain model file."""
    folder = hf_model_folder(plan.model_path)
    if folder is None:
        raise NotExportable("finetune.py loads the weights with from_pretrained, which needs a Hugging Face model: "
                            "plan with --hf CONFIG_OR_ID")
    return folder


def _hf_folder(plan: ExportPlan) -> str:
    from optplan.planner.hf_source import generated_model_file

    folder = _require_hf(plan)
    generated = generated_model_file(plan.model_path)
    match = re.search(r"^MODEL_CLASS = (['\"])(.+?)\1$", generated[1], re.MULTILINE) if generated else None
    cls = match.group(2) if match else "AutoModelForCausalLM"
    if not (cls.endswith(CAUSAL_LM_SUFFIXES) or cls == "AutoModelForCausalLM"):
        raise NotExportable(f"finetune.py trains causal language models with TRL's SFTTrainer, and this model is a "
                            f"{cls}: export train.py (--to train) for a full fine-tune")
    return folder


def _model_dtype(plan: ExportPlan) -> str:
    """The ``from_pretrained`` dtype: a LoRA base in the recipe's 16-bit dtype; a full fine-tune keeps fp32 weights
    (the masters) except under ``bf16-pure``."""
    if plan.adapter is None and plan.strategy.precision != "bf16-pure":
        return "float32"
    return _DTYPES.get(plan.strategy.precision, "bfloat16")


def distributed_config(plan: ExportPlan) -> dict[str, Any] | None:
    """``DistributedConfig`` keyword arguments of a tensor-parallel plan (None without tensor parallelism)."""
    s = plan.strategy
    if s.tp == 1:
        return None
    replicas = plan.nodes if s.fsdp == "hybrid" and plan.multi_node else 1
    if s.dp % replicas:
        raise NotExportable(f"HSDP keeps one replica per node, and dp {s.dp} does not split over {replicas} nodes: "
                            "plan with --fsdp full")
    out: dict[str, Any] = {"tp_size": s.tp, "tp_plan": "auto", "fsdp_size": s.dp // replicas}
    if replicas > 1:
        out["dp_replicate_size"] = replicas
    if s.fsdp != "none":
        out["fsdp_mixed_precision"] = s.precision in ("bf16", "amp-bf16")
        out["fsdp_cpu_offload"] = s.offload_params != "none"
    return out


def finetune_config(plan: ExportPlan) -> dict[str, Any]:
    """The ``finetune.json`` document for ``plan`` (a fresh JSON-serialisable dict); NotExportable when the
    plan cannot be launched this way (module docstring)."""
    folder = _check_exportable(plan)
    s, adapter = plan.strategy, plan.adapter
    lora = None if adapter is None else {
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout, "bias": "none",
        "target_modules": list(adapter.targets), "task_type": "CAUSAL_LM"}
    dist = distributed_config(plan)
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
        "bf16": s.precision in ("amp-bf16", "bf16-pure", "bf16"), "fp16": s.precision == "amp-fp16",
        "optim": OPTIM_NAMES[s.optimizer], "report_to": "none",
        "learning_rate": QLORA_LEARNING_RATE if adapter is not None else FULL_LEARNING_RATE,
    }
    field = checkpointing_field()  # TrainingArguments' name in the installed transformers (hf.py)
    sft[field] = s.checkpointing == "full" and (s.fsdp == "none" or dist is not None)
    if sft[field]:
        sft[f"{field}_kwargs"] = {"use_reentrant": False}
    if plan.seq_len:
        sft["max_length"] = plan.seq_len
    if adapter is None and dist is None:  # a full fine-tune on DDP, FSDP or DeepSpeed: the hf export's arguments
        from optplan.planner.export.hf import hf_training_args

        sft = {**hf_training_args(plan, ds_config_name=DS_CONFIG_NAME), "report_to": "none"}
        if s.engine != "deepspeed":  # DeepSpeed's optimizer section names its own (HF compares the two)
            sft["learning_rate"] = FULL_LEARNING_RATE
        if plan.seq_len:
            sft["max_length"] = plan.seq_len
    elif s.fsdp != "none" and dist is None:
        sft["fsdp"] = "full_shard auto_wrap" if s.fsdp == "full" else "shard_grad_op auto_wrap"
        sft["fsdp_config"] = {"version": 2, "reshard_after_forward": FSDP_RESHARD[s.fsdp],
                              "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "transformer_layer_cls_to_wrap": [plan.block_class],
                              "activation_checkpointing": s.checkpointing == "full"}
        if s.offload_params != "none":
            sft["fsdp_config"]["cpu_offload"] = True
    elif plan.world_size > 1 and dist is None:
        sft["ddp_find_unused_parameters"] = False
    sft.update(fsdp_accumulation_args(s))  # torch TP over dp > 1 is FULL_SHARD too (distributed_config checks)
    if s.compile:
        sft["torch_compile"] = True  # the Trainer's torch.compile (the plan priced fused elementwise kernels)
    model: dict[str, Any] = {"name_or_path": folder, "dtype": _model_dtype(plan)}
    if dist is not None:
        model["distributed_config"] = dist
    return {"plan": s.label(), "model": model, "lora": lora, "bnb": bnb, "sft": sft}


def render_finetune_json(plan: ExportPlan) -> str:
    return json.dumps(finetune_config(plan), indent=2) + "\n"


SCRIPT = '''"""Generated by optplan: a {what} fine-tune that applies the plan in finetune.json ({label}).

    torchrun --nproc-per-node {procs} finetune.py --dataset DATA   (or: python finetune.py --dataset DATA)

DATA is a datasets hub name or a local .json/.jsonl/.csv/.parquet file with a "text" column (or chat
"messages"), as TRL's SFTTrainer takes it. Needs torch, transformers, trl, datasets{needs}; not optplan.
--dry-run loads the model as planned and runs one forward and backward on one micro-batch (no optimizer
step), then prints the loss and, on a GPU, the peak allocated and reserved memory (the caching allocator's margin
over the tensors): a check that the plan fits before a long run.
"""

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCAL_FORMATS = {{".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}}


def load_model(cfg, name_or_path):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {{"dtype": getattr(torch, cfg["model"]["dtype"])}}
    if cfg["bnb"]:
        from transformers import BitsAndBytesConfig

        bnb = {{k: getattr(torch, v) if k.endswith("_dtype") or k.endswith("_storage") else v
               for k, v in cfg["bnb"].items()}}
        kwargs["quantization_config"] = BitsAndBytesConfig(**bnb)
    if cfg["model"].get("distributed_config"):
        from transformers.distributed import DistributedConfig  # transformers >= 5

        kwargs["distributed_config"] = DistributedConfig(**cfg["model"]["distributed_config"])
    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def _row_text(row, tokenizer):
    """A dataset row as text: its "text", else its chat "messages" through the tokenizer's chat template (their
    contents one per line when the tokenizer has none), as SFTTrainer formats them."""
    if "text" in row:
        return row["text"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(row["messages"], tokenize=False)
    return "\\n".join(message["content"] for message in row["messages"])


def dry_run(model, data, cfg, name_or_path):
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    sft = cfg["sft"]
    texts = [_row_text(row, tokenizer)
             for row in data.select(range(min(len(data), sft["per_device_train_batch_size"])))]
    batch = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True,
                      max_length=sft.get("max_length") or 1024)
    if cfg["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**cfg["lora"]))
    if sft.get("activation_checkpointing") or sft.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable({{"use_reentrant": False}})
    device = next(model.parameters()).device
    batch = {{k: v.to(device) for k, v in batch.items()}}
    dtype = torch.bfloat16 if sft.get("bf16") else torch.float16 if sft.get("fp16") else None
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    text = f"dry run: loss {{loss.item():.4f}}"
    if device.type == "cuda":  # the plan's allocated peak, and the caching allocator's margin over it
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        text += (f", peak allocated {{allocated / 2**30:.2f}} GiB, reserved {{reserved / 2**30:.2f}} GiB "
                 f"(allocator margin {{100 * (reserved / max(1, allocated) - 1):.1f}} %)")
    print(text)


def leave_process_group():
    """Leave torch.distributed cleanly when it was started (transformers' tensor-parallel loading, the Trainer): a
    rank that exits with its process group alive can abort in the group's destructor ("terminate called without an
    active exception") while another rank still finishes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description="fine-tune with the optplan plan in finetune.json")
    parser.add_argument("--dataset", required=True, help="datasets hub name or a local json/jsonl/csv/parquet file")
    parser.add_argument("--model", default=None, help="model folder or hub id (default: finetune.json's)")
    parser.add_argument("--config", default=str(HERE / "finetune.json"))
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke test of the script)")
    parser.add_argument("--dry-run", action="store_true", help="one forward and backward, then stop")
    args = parser.parse_args()
    cfg = json.loads(Path(args.config).read_text(encoding="utf-8"))
    name_or_path = args.model or cfg["model"]["name_or_path"]

    from datasets import load_dataset

    model = load_model(cfg, name_or_path)
    path = Path(args.dataset)
    if path.suffix in LOCAL_FORMATS and path.is_file():
        data = load_dataset(LOCAL_FORMATS[path.suffix], data_files=str(path), split="train")
    else:
        data = load_dataset(args.dataset, split="train")
    if args.dry_run:
        dry_run(model, data, cfg, name_or_path)
        leave_process_group()
        return
    from trl import SFTConfig, SFTTrainer

    peft_config = None
    if cfg["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(**cfg["lora"])
    sft = dict(cfg["sft"])
    if sft.get("deepspeed") and not Path(sft["deepspeed"]).is_file():
        sft["deepspeed"] = str(HERE / sft["deepspeed"])  # the ds_config.json written beside this script
    trainer = SFTTrainer(model=model, args=SFTConfig(**sft, max_steps=args.max_steps, use_cpu=args.cpu),
                         train_dataset=data, peft_config=peft_config)
    trainer.train()
    trainer.save_model()
    leave_process_group()


if __name__ == "__main__":
    main()
'''


def render_finetune_py(plan: ExportPlan) -> str:
    _check_exportable(plan)
    needs = (", peft" if plan.adapter is not None else "") + (", bitsandbytes" if plan.strategy.quant != "none" else "")
    what = "full" if plan.adapter is None else ("QLoRA" if plan.strategy.quant != "none" else "LoRA")
    return SCRIPT.format(label=plan.strategy.label(), procs=plan.procs_per_node, needs=needs, what=what)


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
    try:
        import torch
        from transformers import BitsAndBytesConfig, TrainingArguments
    except ImportError as exc:
        raise ExportValidationError(f"cannot import {exc.name} to check finetune.json: pip install transformers") \
            from exc
    if adapter is not None:
        _check_lora(cfg.get("lora"), adapter)
    elif cfg.get("lora"):
        raise ExportValidationError("finetune.json adds LoRA adapters to a plan that trains every parameter: "
                                    "re-export")
    _check_distributed(cfg["model"].get("distributed_config"), plan)
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
    full_hf = adapter is None and s.tp == 1  # the hf export's arguments: checked as hf_training_args.json is
    if full_hf:
        from optplan.planner.export.hf_check import validate_hf_training_args

        ds = None
        if s.engine == "deepspeed":
            from optplan.planner.export.deepspeed import render_ds_config

            ds = render_ds_config(s, plan.buckets)
        trainer_part = {k: v for k, v in cfg["sft"].items() if k != "max_length"}
        validate_hf_training_args(json.dumps(trainer_part), plan, ds_config=ds)
    try:
        from trl import SFTConfig as ArgsClass
    except ImportError:  # check the TrainingArguments part only
        ArgsClass = TrainingArguments
        sft = {k: v for k, v in cfg["sft"].items() if k not in ("max_length",)}
    else:
        sft = dict(cfg["sft"])
    sft.pop("deepspeed", None)  # the ds_config file: checked above with HF's own DeepSpeed integration
    try:
        args = ArgsClass(**sft, use_cpu=True)
    except Exception as exc:
        raise ExportValidationError(f"{ArgsClass.__name__} rejects finetune.json: {exc}") from exc
    checkpointing = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing",
                                                                                    False))
    got = (args.per_device_train_batch_size, args.gradient_accumulation_steps, bool(args.bf16), checkpointing)
    want_args = (s.mbs, s.grad_accum, s.precision in ("amp-bf16", "bf16-pure", "bf16"),
                 s.checkpointing == "full" and (s.fsdp == "none" or s.tp > 1))
    if full_hf:
        want_args = (*want_args[:2], got[2], want_args[3])  # bf16 follows ds_config under DeepSpeed: checked above
        want_args = (*want_args[:3], s.checkpointing == "full" and s.fsdp == "none")
    if got != want_args:
        raise ExportValidationError(f"{ArgsClass.__name__} from finetune.json has (mbs, accumulation, bf16, "
                                    f"checkpointing) {got}, the plan {want_args}: re-export")


def _check_lora(doc: Any, adapter: Any) -> None:
    from optplan.planner.validate import ExportValidationError

    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ExportValidationError("cannot import peft to check finetune.json's LoRA section: pip install peft") \
            from exc
    try:
        lora = LoraConfig(**doc)
    except Exception as exc:
        raise ExportValidationError(f"peft LoraConfig rejects finetune.json: {exc}") from exc
    if ((lora.r, lora.lora_alpha, set(lora.target_modules), lora.lora_dropout)
            != (adapter.rank, adapter.alpha, set(adapter.targets), adapter.dropout)):
        raise ExportValidationError("finetune.json's LoRA rank, alpha, targets or dropout differ from the plan's: "
                                    "re-export")


def _check_distributed(doc: Any, plan: ExportPlan) -> None:
    """Build transformers' ``DistributedConfig`` from finetune.json and check its mesh against the plan."""
    from optplan.planner.validate import ExportValidationError

    s = plan.strategy
    if doc is None:
        if s.tp > 1:
            raise ExportValidationError(f"finetune.json has no distributed_config for the plan's tp {s.tp}: re-export")
        return
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        raise ExportValidationError("tensor parallelism by the model's tp_plan needs transformers >= 5 "
                                    "(transformers.distributed.DistributedConfig): pip install -U transformers") from exc
    try:
        dist = DistributedConfig(**doc)
    except Exception as exc:
        raise ExportValidationError(f"transformers DistributedConfig rejects finetune.json: {exc}") from exc
    replicas = dist.dp_replicate_size or 1
    got = (dist.tp_size, (dist.fsdp_size or 1) * replicas, dist.fsdp_cpu_offload)
    want = (s.tp, s.dp, s.offload_params != "none")
    if got != want:
        raise ExportValidationError(f"DistributedConfig from finetune.json has (tp, dp, cpu offload) {got}, the plan "
                                    f"{want}: re-export")
    if dist.tp_size * (dist.fsdp_size or 1) * replicas != plan.world_size:
        raise ExportValidationError(f"DistributedConfig's mesh covers {dist.tp_size * (dist.fsdp_size or 1) * replicas}"
                                    f" processes, the plan {plan.world_size}: re-export")
