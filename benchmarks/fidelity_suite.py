"""The fidelity suite's cases (benchmarks/fidelity.py runs them): the models (examples/ files, the Llama-3 1B
layout reduced for CPU runs, timm models through ``--hf`` configs) and the (model, precision, micro-batch,
checkpointing, engine) cases, with where each runs (CPU, GPU, ``--quick``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from optplan.estimators.strategy import Strategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_files import example_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

LLAMA_CPU_SHAPE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=1, ffn_dim=768)
"""examples/llama.py's 1B layout (vocabulary 128256, tied embeddings, GQA, SwiGLU) reduced for CPU runs
(as benchmarks/fidelity_cpu_memory.py --quick): 36 M parameters, most of them the embedding."""
EMULATED_BF16_VOCAB = 8192
"""The CPU Llama's vocabulary where the CPU has no native bf16 (no AVX512-BF16: torch emulates bf16 matmuls some
20-40x slower than fp32, and the 128K-vocabulary logits of the amp-bf16 cases took ~100 s a step on a 2-core AVX2
EPYC): the memory comparison is the same mechanism at a smaller embedding, and the quick suite fits its budget."""


LLAMA_CPU_QUICK_SHAPE = dict(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=384, vocab_size=2048)
LLAMA_CPU_QUICK_SEQ = 64
"""The CPU's --quick Llama (tests/benchmarks/test_gpu_campaign.py runs it in CI): the same layout (GQA, SwiGLU,
tied embeddings, RoPE) at 0.6 M parameters, seq 64, so that its amp-bf16 cases cost no more than process start-up
where the CPU emulates bf16 (~0.5 GFLOP/s on a 2-core AVX2 EPYC, 90x below fp32)."""


def llama_cpu_shape() -> dict[str, int]:
    """``LLAMA_CPU_SHAPE``, with ``EMULATED_BF16_VOCAB`` where this CPU emulates bf16."""

    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)()
    return dict(LLAMA_CPU_SHAPE) if native else {**LLAMA_CPU_SHAPE, "vocab_size": EMULATED_BF16_VOCAB}


# ---------------------------------------------------------------------------------------------------
# the suite
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """One model file, as this device runs it."""

    key: str
    describe: str
    path: Path
    seq_len: int | None
    optimizer: str
    mbs_scale: int = 1
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One (model, strategy) case: ``mode`` is single, ddp, fsdp-full, fsdp-grad_op or zero1/2/3."""

    model: str
    precision: str
    mbs: int
    checkpointing: str = "none"
    mode: str = "single"
    quick: bool = False
    where: tuple[str, ...] = ("cpu", "cuda")
    procs: int | None = None  # None: 1 for single, else 2
    compile: bool = False  # the plan's torch.compile of each block (GPU cases: the eager twin beside it)
    # in the CPU's --quick subset (None: as ``quick``). That subset (CI runs it) leaves out what it would only
    # repeat: the MLP's DDP, FSDP2 and ZeRO-2 cases (the same training loop's 2-rank runs are checked within 2 %
    # by tests/planner/test_train_script.py's matrix and tests/probes/test_distributed_probe.py) and the Llama's
    # amp-bf16 case with full checkpointing (the MLP's amp-bf16 case checkpoints; the Llama keeps selective)
    cpu_quick: bool | None = None

    def in_quick(self, device: str) -> bool:
        """Whether the case is in ``device``'s --quick subset."""
        return self.quick if device != "cpu" or self.cpu_quick is None else self.cpu_quick

    @property
    def nproc(self) -> int:
        if self.procs is not None:
            return self.procs
        return 1 if self.mode == "single" else 2


SUITE: tuple[Case, ...] = (
    # the first case of each model is single-process: on a GPU it is the model's calibration probe
    Case("mlp", "fp32", 1, quick=True),
    Case("mlp", "fp32", 4),
    Case("mlp", "amp-bf16", 4, "full", quick=True),
    Case("mlp", "fp32", 4, mode="ddp", quick=True, cpu_quick=False),
    Case("mlp", "fp32", 4, mode="fsdp-full", quick=True, cpu_quick=False),
    Case("mlp", "fp32", 4, mode="fsdp-grad_op"),
    Case("mlp", "fp32", 4, mode="zero1"),
    Case("mlp", "fp32", 4, mode="zero2", quick=True, cpu_quick=False),
    Case("mlp", "fp32", 4, mode="zero3"),
    Case("mlp", "fp32", 4, mode="zero0", procs=1, quick=True),
    Case("gpt2", "fp32", 1),
    Case("gpt2", "fp32", 4),
    Case("gpt2", "amp-bf16", 4),
    Case("gpt2", "fp32", 4, "full"),
    Case("gpt2", "amp-bf16", 4, "full"),
    Case("gpt2", "amp-bf16", 4, "selective"),
    Case("gpt2", "amp-bf16", 4, "full:6"),  # partial checkpointing: the first 6 of 12 blocks
    Case("gpt2", "bf16", 2, where=("cuda",), quick=True),
    Case("gpt2", "bf16-pure", 2, where=("cuda",)),
    Case("gpt2", "bf16", 2, where=("cuda",), compile=True),
    Case("gpt2", "fp32", 2, mode="ddp", where=("cuda",)),
    Case("llama", "fp32", 1, quick=True),
    Case("llama", "fp32", 2),
    Case("llama", "amp-bf16", 2, quick=True),
    Case("llama", "fp32", 4, "full"),
    Case("llama", "amp-bf16", 4, "full", quick=True, cpu_quick=False),
    Case("llama", "bf16", 2),
    Case("llama", "bf16-pure", 2),
    Case("llama", "amp-bf16", 2, "selective", quick=True),
    Case("llama", "bf16", 2, "selective", where=("cuda",)),
    Case("llama", "bf16", 2, "full:8", where=("cuda",)),  # partial: the first 8 of 16 blocks
    Case("llama", "bf16", 2, where=("cuda",), compile=True),  # eager vs compiled: the elementwise pricing
    Case("llama", "bf16", 2, "selective", where=("cuda",), compile=True),
    Case("llama", "fp32", 2, mode="ddp"),
    Case("llama", "fp32", 2, mode="fsdp-full"),
    Case("llama", "fp32", 2, "full", mode="fsdp-grad_op"),
    Case("llama", "fp32", 2, "selective", mode="fsdp-full"),
    Case("llama", "fp32", 2, mode="zero1"),
    Case("llama", "fp32", 2, mode="zero2"),
    Case("llama", "fp32", 2, "full", mode="zero3"),
    Case("llama", "bf16", 2, mode="fsdp-full", where=("cuda",)),
    Case("llama", "bf16", 2, mode="zero2", where=("cuda",)),
    Case("llama", "bf16", 2, mode="zero3", where=("cuda",)),
    Case("resnet", "fp32", 1),
    Case("resnet", "fp32", 2),
    Case("resnet", "amp-bf16", 2),
    Case("resnet", "fp32", 4, "full"),
    Case("resnet", "bf16", 2, where=("cuda",), quick=True),
    # 16-bit ResNet-50 at micro-batches 64 and 128 (x16): where the device's element-wise work should outgrow the
    # host's kernel launches (estimators/eager_host.py's open question: at 32 the two take about as long)
    Case("resnet", "amp-bf16", 4, where=("cuda",)),
    Case("resnet", "amp-bf16", 8, where=("cuda",)),
    # timm through --hf (transformers' TimmWrapperForImageClassification over timm.create_model)
    Case("timm-vit", "fp32", 2),
    Case("timm-vit", "amp-bf16", 4, "full"),
    Case("timm-vit", "amp-bf16", 4, "selective"),
    Case("timm-vit", "fp32", 2, mode="fsdp-full"),
    Case("timm-vit", "bf16", 4, where=("cuda",)),
    Case("timm-resnet", "fp32", 2),
    Case("timm-resnet", "amp-bf16", 2),
    # timm's ResNet-50 as fidelity_convnets.py writes it (SGD, 1000 classes), channels-first and channels-last twins:
    # the counted-traffic model's layout term (estimators/counted_traffic.py NCHW_TRANSPOSE_PASSES, fitted on an
    # RTX 3090) and TF32 convolutions under fp32, first measured on Hopper
    Case("r50-nchw", "amp-bf16", 8, where=("cuda",)),
    Case("r50-nhwc", "amp-bf16", 8, where=("cuda",)),
    Case("r50-nchw", "fp32", 4, where=("cuda",)),
    Case("r50-nhwc", "fp32", 4, where=("cuda",)),
    # DeepSpeed at world size 1 (a one-GPU machine runs no 2-process case): ZeRO-0..3 on the Llama layout
    Case("llama", "bf16", 2, mode="zero0", procs=1, where=("cuda",), quick=True),
    Case("llama", "bf16", 2, mode="zero1", procs=1, where=("cuda",)),
    Case("llama", "bf16", 2, mode="zero2", procs=1, where=("cuda",)),
    Case("llama", "bf16", 2, "full", mode="zero3", procs=1, where=("cuda",), quick=True),
    Case("gpt2", "amp-bf16", 2, mode="zero2", procs=1, where=("cuda",)),
    # GPT-2 small at micro-batch 64 with its vocabulary as is (50,257: unaligned head GEMMs) and padded to 50,304:
    # what estimators/vocab_padding.py's note says padding saves
    Case("gpt2", "bf16", 16, where=("cuda",)),
    Case("gpt2-pad", "bf16", 16, where=("cuda",)),
)


def llama_wrapper(directory: Path, shape: dict[str, int] | None, seq_len: int) -> Path:
    """A model file building examples/llama.py's 1B layout with ``shape`` overrides (None: as is)."""
    path = directory / "llama_fidelity.py"
    path.write_text(example_source("llama", "1B", shape, {"seq_len": seq_len, "optimizer": "adamw"}),
                    encoding="utf-8")
    return path


def timm_model(directory: Path, architecture: str, side: int, classes: int) -> Path:
    """The model file ``optplan --hf`` generates for a timm config of ``architecture`` (the timm/... hub layout:
    ``architecture``, ``num_classes``, ``pretrained_cfg.input_size``) at ``side`` x ``side`` pixels. Building it
    needs timm (and, on a CPU-only torch, benchmarks/torchvision_ops/install.py)."""
    from optplan.planner.hf_source import find_hf_config, write_hf_model_file

    folder = directory / architecture
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architecture": architecture, "num_classes": classes,
              "pretrained_cfg": {"input_size": [3, side, side], "num_classes": classes}}
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return write_hf_model_file(find_hf_config(str(folder)), folder)


def convnet_model(directory: Path, architecture: str, side: int, layout: str) -> Path:
    """benchmarks/fidelity_convnets.py's model file of a timm ``architecture`` at ``side`` pixels in ``layout``
    (nchw or nhwc: model and input in ``torch.channels_last``), the file its published rows are priced with."""
    import fidelity_convnets  # imports timm: only where a convnet model is asked for

    return fidelity_convnets.model_file(directory, (architecture, side, layout))


def models(device: str, tmp: Path, *, quick: bool = False) -> dict[str, Model]:
    """The suite's models as ``device`` runs them (``quick`` on the CPU: the smaller Llama, LLAMA_CPU_QUICK_SHAPE)."""
    if device == "cpu":
        shape, seq = (LLAMA_CPU_QUICK_SHAPE, LLAMA_CPU_QUICK_SEQ) if quick else (llama_cpu_shape(), 128)
        return {
            "mlp": Model("mlp", "examples/mlp.py as is (in 64, hidden 256, depth 4); micro-batches x16",
                         EXAMPLES / "mlp.py", None, "adamw", mbs_scale=16),
            "gpt2": Model("gpt2", "examples/gpt2.py GPT-2 small (124 M) as is, seq 128", EXAMPLES / "gpt2.py",
                          128, "adamw"),
            "llama": Model("llama", "examples/llama.py 1B layout reduced: " + ", ".join(
                f"{k} {v}" for k, v in shape.items()) + f" (vocab 128256 unless given, tied), seq {seq}",
                llama_wrapper(tmp, shape, seq), seq, "adamw"),
            "resnet": Model("resnet", "examples/resnet.py ResNet-50 as is, 224x224, SGD", EXAMPLES / "resnet.py",
                            None, "sgd"),
            "timm-vit": Model("timm-vit", "timm vit_tiny_patch16_224 (--hf timm config), 224x224, 100 classes",
                              timm_model(tmp, "vit_tiny_patch16_224", 224, 100), None, "adamw"),
            "timm-resnet": Model("timm-resnet", "timm resnet18 (--hf timm config), 160x160, 100 classes",
                                 timm_model(tmp, "resnet18", 160, 100), None, "adamw"),
        }
    return {
        "mlp": Model("mlp", "examples/mlp.py as is; micro-batches x256", EXAMPLES / "mlp.py", None, "adamw",
                     mbs_scale=256),
        "gpt2": Model("gpt2", "examples/gpt2.py GPT-2 small (124 M), seq 1024; micro-batches x4",
                      EXAMPLES / "gpt2.py", 1024, "adamw", mbs_scale=4),
        "gpt2-pad": Model("gpt2-pad", "examples/gpt2.py GPT-2 small with its vocabulary padded to 50,304, seq 1024; "
                          "micro-batches x4", EXAMPLES / "gpt2.py", 1024, "adamw", mbs_scale=4,
                          env={"OPTPLAN_GPT2_CONFIG": '{"vocab_size": 50304}'}),
        "llama": Model("llama", "examples/llama.py Llama-3 1B as is, seq 1024", llama_wrapper(tmp, None, 1024),
                       1024, "adamw"),
        "resnet": Model("resnet", "examples/resnet.py ResNet-50, 224x224, SGD; micro-batches x16",
                        EXAMPLES / "resnet.py", None, "sgd", mbs_scale=16),
        "timm-vit": Model("timm-vit", "timm vit_base_patch16_224 (--hf timm config), 224x224, 1000 classes; "
                          "micro-batches x16", timm_model(tmp, "vit_base_patch16_224", 224, 1000), None, "adamw",
                          mbs_scale=16),
        "timm-resnet": Model("timm-resnet", "timm resnet50 (--hf timm config), 224x224, 1000 classes; "
                             "micro-batches x16", timm_model(tmp, "resnet50", 224, 1000), None, "adamw",
                             mbs_scale=16),
        **{f"r50-{layout}": Model(f"r50-{layout}", f"timm resnet50 model file (fidelity_convnets.py), 224x224, "
                                  f"{'channels-last' if layout == 'nhwc' else 'channels-first'}, SGD; micro-batches x16",
                                  convnet_model(tmp, "resnet50", 224, layout), None, "sgd", mbs_scale=16)
           for layout in ("nchw", "nhwc")},
    }


def strategy_of(case: Case, model: Model) -> Strategy:
    """``case``'s plan; a checkpointing of ``full:N`` is full checkpointing of the first N blocks (partial)."""
    mode, _, count = case.checkpointing.partition(":")
    kwargs: dict[str, Any] = {"precision": case.precision, "optimizer": model.optimizer,
                              "mbs": case.mbs * model.mbs_scale, "checkpointing": mode,
                              "checkpoint_layers": int(count) if count else None,
                              "dp": case.nproc, "engine": "torch", "compile": case.compile}
    if case.mode == "fsdp-full":
        kwargs["fsdp"] = "full"
    elif case.mode == "fsdp-grad_op":
        kwargs["fsdp"] = "grad_op"
    elif case.mode.startswith("zero"):
        kwargs.update(engine="deepspeed", zero=int(case.mode[4:]))
    return Strategy(**kwargs)


def label_of(case: Case, strategy: Strategy) -> str:
    mode = {"single": "torch", "ddp": "DDP", "fsdp-full": "FSDP-full", "fsdp-grad_op": "FSDP-grad_op",
            "zero0": "ZeRO-0", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[case.mode]
    ckpt = {"full": " ckpt", "selective": " sel"}.get(case.checkpointing, "")
    if strategy.checkpoint_layers is not None:
        ckpt = f" ckpt{strategy.checkpoint_layers}"
    return f"{case.precision} {mode} mbs{strategy.mbs}{ckpt}{' compile' if case.compile else ''}"


# ---------------------------------------------------------------------------------------------------
