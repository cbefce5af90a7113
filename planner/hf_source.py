"""Hugging Face models without a model file (``--hf``): find the config, write the model file optplan profiles.

``--hf`` takes a ``config.json``, a model folder holding one, or a hub id ``org/name`` found in the local
Hugging Face cache. optplan never downloads: the cache is read as huggingface_hub lays it out
(``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; a repository is
``models--org--name`` with ``snapshots/<revision>/config.json``, the revision named by ``refs/main`` tried
first: huggingface_hub's "Understand caching" guide).

The config is read here as JSON (transformers is not imported in this process). The model is built by a
generated model file: ``build_model()`` instantiates the config's architecture (``architectures[0]``, or
``--hf-class``) from transformers over ``AutoConfig.from_pretrained(config.json)``, with random weights;
causal and masked language models get an ``example_batch`` of token ids with ``labels`` and a ``loss_fn``
returning the model's own loss; image classifiers (``...ForImageClassification``) one of random ``pixel_values``
at the config's ``image_size`` and ``num_channels`` with class ``labels``. timm's configs (the ``timm/...`` hub
repositories: ``architecture`` and ``pretrained_cfg``, no ``model_type``) are built as transformers builds them,
through ``TimmWrapperForImageClassification`` (transformers' ``is_timm_config_dict`` rule; the image side and
channels from ``pretrained_cfg.input_size``, the classes from ``num_classes``), which calls
``timm.create_model(architecture, pretrained=False, **model_args)``. It is written once to the optplan cache (``hf/<name>-<hash>.py``, atomic),
so profiling, probes, exports and train.py treat it as any model file. Its ``OPTPLAN["seq_len"]`` is the
config's maximum positions capped at :data:`DEFAULT_HF_SEQ_LEN` (``--seq-len`` overrides); a config.json that names
none gets its transformers class's default (GPT-2's 1024), read by the generated file when it is imported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from optplan.estimators.errors import OptplanError
from optplan.probes.cache_dir import cache_dir

DEFAULT_HF_SEQ_LEN = 4096
"""The sequence length a ``--hf`` model is profiled at when ``--seq-len`` is not given: its maximum positions,
at most this many tokens (long-context models list 128k positions; fine-tuning runs mostly use 2-8k)."""
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
LABELLED_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
"""Model classes whose forward takes ``labels`` and returns the loss (token models)."""
IMAGE_SUFFIXES = ("ForImageClassification",)
"""Vision classes whose forward takes ``pixel_values`` and ``labels`` and returns the loss (transformers' ViT,
DeiT, Swin, ConvNeXt, ResNet... image classification heads)."""
NO_CACHE_MODEL_TYPES = ("falcon", "gemma2", "gemma3", "gemma3_text", "gpt2")
"""Model types whose generated file turns the generation cache off: with it on, their fake-tensor profile fails in
backward (keys grown to twice the sequence; GPT-2's attention, given no mask, then slices the grown keys in the
checkpointed recompute: "aten.slice.Tensor encountered during backward but not found in storage"). Not for every model: with the cache off, transformers materialises the
causal mask on fake tensors (it cannot check the mask's values), which over-counts a Llama's activations by ~2 %
(benchmarks/fidelity_finetune_cpu.py), while a real step holds the same bytes either way."""
DEFAULT_IMAGE_SIZE = 224
"""The input side of a vision config that names none (ImageNet's 224 x 224, the transformers configs' default)."""
TIMM_MODEL_TYPE = "timm_wrapper"
"""The ``model_type`` transformers gives a timm config (``PretrainedConfig.get_config_dict``: a dict with
``pretrained_cfg`` and no ``model_type``), built by :data:`TIMM_CLASS`."""
TIMM_CLASS = "TimmWrapperForImageClassification"
DOWNLOAD_FIX = ("download its config first (huggingface-cli download {id} config.json), or pass the path of a "
                "config.json or model folder")


class HfSource(BaseModel):
    """A Hugging Face model config found for ``--hf`` (read as JSON, never executed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: str
    config_path: str
    name: str
    model_type: str
    model_class: str
    vocab_size: int | None = None
    max_positions: int | None = None
    image_size: int | None = None
    num_channels: int | None = None
    num_labels: int | None = None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
    return Path(home).expanduser() / "hub"


def _cached_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local hub cache: the ``refs/main`` snapshot, else the newest one."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
        if pinned.is_file():
            return pinned
    found = sorted((p for p in snapshots.glob("*/config.json") if p.is_file()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def find_hf_config(spec: str, hf_class: str | None = None) -> HfSource:
    """The :class:`HfSource` of ``--hf spec`` (a config.json, a folder holding one, or a cached hub id);
    one-line :class:`OptplanError` with the fix for anything missing or not a model config."""
    path = Path(spec).expanduser()
    if path.is_dir():
        config, name = path / "config.json", path.resolve().name
        if not config.is_file():
            raise OptplanError(f"--hf {spec}: the folder has no config.json: pass a Hugging Face model folder or the "
                               "path of its config.json")
    elif path.is_file():
        config, name = path, path.resolve().parent.name if path.name == "config.json" else path.stem
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", spec) and not spec.endswith(".json"):
        cached = _cached_config(spec)
        if cached is None:
            raise OptplanError(f"--hf {spec}: not a file or folder, and not in the local Hugging Face cache "
                               f"({hub_cache_dir()}); optplan never downloads: {DOWNLOAD_FIX.format(id=spec)}")
        config, name = cached, spec.split("/")[-1]
    else:
        raise OptplanError(f"--hf {spec}: no such file or folder: pass a config.json, a model folder or a hub id "
                           "org/name that is in the local Hugging Face cache")
    return _read_config(spec, config, name, hf_class)


def _read_config(spec: str, config: Path, name: str, hf_class: str | None) -> HfSource:
    try:
        doc = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OptplanError(f"--hf {spec}: {config} is not readable JSON ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:120]}): pass a Hugging Face config.json") from None
    if isinstance(doc, dict) and "model_type" not in doc and isinstance(doc.get("pretrained_cfg"), dict):
        return _read_timm_config(spec, config, name, hf_class, doc)
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str) or not doc["model_type"]:
        raise OptplanError(f"--hf {spec}: {config} is not a Hugging Face model config (no \"model_type\"): pass the "
                           "config.json of a model (the one beside its weights)")
    architectures = doc.get("architectures")
    if hf_class is not None:
        if not re.fullmatch(r"[A-Za-z_]\w*", hf_class):
            raise OptplanError(f"--hf-class {hf_class!r} is not a class name: give a transformers class such as "
                               "LlamaForCausalLM or AutoModelForCausalLM")
        model_class = hf_class
    elif isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        model_class = architectures[0]
    else:
        model_class = "AutoModelForCausalLM"
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    vocab = text.get("vocab_size") if isinstance(text.get("vocab_size"), int) else None
    positions = next((text[k] for k in MAX_POSITION_KEYS if isinstance(text.get(k), int) and text[k] > 0), None)
    vision = doc.get("vision_config") if isinstance(doc.get("vision_config"), dict) else doc
    image = vision.get("image_size")
    if isinstance(image, list) and image and isinstance(image[0], int):
        image = image[0]
    labels = doc.get("num_labels")
    if not isinstance(labels, int):
        id2label = doc.get("id2label")
        labels = len(id2label) if isinstance(id2label, dict) and id2label else None
    return HfSource(spec=spec, config_path=str(config.resolve()), name=name, model_type=doc["model_type"],
                    model_class=model_class, vocab_size=vocab, max_positions=positions,
                    image_size=image if isinstance(image, int) and image > 0 else None,
                    num_channels=vision.get("num_channels") if isinstance(vision.get("num_channels"), int) else None,
                    num_labels=labels)


def _read_timm_config(spec: str, config: Path, name: str, hf_class: str | None, doc: dict) -> HfSource:
    """The :class:`HfSource` of a timm config (``architecture``, ``pretrained_cfg``; timm's ``_parse_model_cfg``
    reads the same fields): input size from ``model_args`` (``img_size``, ``in_chans``) over
    ``pretrained_cfg.input_size`` (channels, height, width), classes from ``num_classes``."""
    if not isinstance(doc.get("architecture"), str) or not doc["architecture"]:
        raise OptplanError(f"--hf {spec}: {config} has a timm pretrained_cfg but no \"architecture\": pass the "
                           "config.json of a timm model (from a timm/... hub repository)")
    if hf_class is not None and hf_class != TIMM_CLASS:
        raise OptplanError(f"--hf-class {hf_class}: {config} is a timm config, which transformers builds only as "
                           f"{TIMM_CLASS}: drop --hf-class")
    pretrained = doc["pretrained_cfg"]
    args = doc.get("model_args") if isinstance(doc.get("model_args"), dict) else {}
    size = pretrained.get("input_size")
    channels, side = (size[0], size[-1]) if isinstance(size, list) and len(size) == 3 else (None, None)
    img = args.get("img_size")
    side = img if isinstance(img, int) else img[-1] if isinstance(img, list) and img else side
    channels = args["in_chans"] if isinstance(args.get("in_chans"), int) else channels
    classes = doc.get("num_classes", pretrained.get("num_classes"))
    if classes == 0:
        raise OptplanError(f"--hf {spec}: {config} is a timm feature extractor (num_classes 0), which transformers "
                           "cannot train as an image classifier: set \"num_classes\" in a copy of config.json to "
                           "your number of classes")
    return HfSource(spec=spec, config_path=str(config.resolve()), name=name, model_type=TIMM_MODEL_TYPE,
                    model_class=TIMM_CLASS, image_size=side if isinstance(side, int) and side > 0 else None,
                    num_channels=channels if isinstance(channels, int) and channels > 0 else None,
                    num_labels=classes if isinstance(classes, int) and classes > 0 else None)


GENERATED_MARK = "Generated by optplan from the Hugging Face config"
"""The first words of every generated model file (how exports recognise one to copy beside train.py)."""


def hf_model_file_text(source: HfSource) -> str:
    """The generated model file of ``source`` (Python source; needs torch and transformers, not optplan)."""
    labelled = source.model_class.endswith(LABELLED_SUFFIXES) or source.model_class == "AutoModelForCausalLM"
    image = source.model_class.endswith(IMAGE_SUFFIXES)
    seq = min(source.max_positions, DEFAULT_HF_SEQ_LEN) if source.max_positions else DEFAULT_HF_SEQ_LEN
    defaults: dict[str, object] = {"name": source.name} if image else {"name": source.name, "seq_len": seq}
    # a config.json without its maximum positions takes its class's default (GPT-2: 1024 positions), which only
    # transformers knows: the file reads it when imported (see _default_seq_len below)
    runtime_seq = not image and not source.max_positions
    optplan_line = (f"OPTPLAN = {{'name': {source.name!r}, 'seq_len': _default_seq_len()}}" if runtime_seq
                    else f"OPTPLAN = {defaults!r}")
    lines = [
        f'"""{GENERATED_MARK} {source.spec} (optplan --hf): {source.model_class}',
        "built from config.json with transformers and random weights (no weights are read). Edit freely: it is a",
        'model file like any other (build_model, example_batch, loss_fn, OPTPLAN)."""',
        "",
        "import torch",
        "import transformers",
        "",
        f"CONFIG_PATH = {source.config_path!r}",
        f"MODEL_CLASS = {source.model_class!r}",
        *([
            "",
            "",
            "def _default_seq_len():",
            f"    \"\"\"config.json names no maximum positions: its class's default, at most {DEFAULT_HF_SEQ_LEN}.\"\"\"",
            "    try:",
            "        config = transformers.AutoConfig.from_pretrained(CONFIG_PATH)",
            "    except (ValueError, KeyError):",
            f"        return {DEFAULT_HF_SEQ_LEN}  # build_model() says why it cannot be read",
            f"    for key in {MAX_POSITION_KEYS!r}:",
            "        value = getattr(config, key, None)",
            "        if isinstance(value, int) and value > 0:",
            f"            return min(value, {DEFAULT_HF_SEQ_LEN})",
            f"    return {DEFAULT_HF_SEQ_LEN}",
            "",
            "",
        ] if runtime_seq else []),
        optplan_line,
        "",
        "",
        "class HfModelError(ValueError):",
        '    """The config or class cannot be built; ``fix`` says what to do (optplan prints it)."""',
        "",
        "    def __init__(self, problem, fix):",
        "        super().__init__(problem)",
        "        self.fix = fix",
        "",
        "",
        "def build_model():",
        "    version = transformers.__version__",
        "    try:",
        "        config = transformers.AutoConfig.from_pretrained(CONFIG_PATH)",
        "    except (ValueError, KeyError) as exc:",
        "        first = str(exc).split(\". \")[0]",
        "        raise HfModelError(f\"transformers {version} cannot read {CONFIG_PATH}: {first}\",",
        "                           \"upgrade transformers (pip install -U transformers), or write a model file for this \"",
        "                           \"architecture\") from None",
        *(["    config.use_cache = False  # with its generation cache on, this model's fake-tensor backward fails"]
          if source.model_type in NO_CACHE_MODEL_TYPES else []),
        "    cls = getattr(transformers, MODEL_CLASS, None)",
        "    if cls is None:",
        "        raise HfModelError(f\"transformers {version} has no class {MODEL_CLASS}\",",
        "                           \"pass --hf-class with a class it has (e.g. AutoModelForCausalLM), or upgrade transformers\")",
        "    return cls.from_config(config) if MODEL_CLASS.startswith(\"Auto\") else cls(config)",
    ]
    if labelled and source.vocab_size:
        lines += [
            "",
            "",
            "def example_batch(batch_size, seq_len):",
            f"    ids = torch.randint(0, {source.vocab_size}, (batch_size, seq_len))",
            "    return {\"input_ids\": ids, \"labels\": ids}",
            "",
            "",
            "def loss_fn(output, batch):",
            "    return output.loss",
        ]
    elif image:
        side = source.image_size or DEFAULT_IMAGE_SIZE
        labels = source.num_labels or 2  # transformers' PretrainedConfig default
        lines += [
            "",
            "",
            "def example_batch(batch_size, seq_len):  # images: seq_len is not used",
            f"    pixels = torch.randn(batch_size, {source.num_channels or 3}, {side}, {side})",
            f"    return {{\"pixel_values\": pixels, \"labels\": torch.randint(0, {labels}, (batch_size,))}}",
            "",
            "",
            "def loss_fn(output, batch):",
            "    return output.loss",
        ]
    return "\n".join(lines) + "\n"


def write_hf_model_file(source: HfSource, folder: Path | None = None) -> Path:
    """Write :func:`hf_model_file_text` to ``folder`` (default ``<optplan cache>/hf``) as
    ``<name>-<hash of the text>.py`` (atomic; an existing identical file is kept) and return its path."""
    text = hf_model_file_text(source)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    safe = re.sub(r"[^A-Za-z0-9_]+", "_", source.name).strip("_") or "model"
    target = (folder or cache_dir() / "hf") / f"{safe}_{digest}.py"
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{safe}-", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        raise OptplanError(f"--hf: cannot write the generated model file to {target.parent} ({exc.strerror or exc}): "
                           "set OPTPLAN_CACHE_DIR to a writable folder") from None
    return target


def require_transformers(source: HfSource | None = None) -> None:
    """One-line OptplanError when transformers (or, for a timm config, timm) cannot be imported (``--hf`` builds
    models with them)."""
    if importlib.util.find_spec("transformers") is None:
        raise OptplanError("--hf builds the model with transformers, which is not installed: pip install transformers")
    if source is not None and source.model_type == TIMM_MODEL_TYPE and importlib.util.find_spec("timm") is None:
        raise OptplanError(f"--hf {source.spec} is a timm model, which transformers builds with timm, not installed: "
                           "pip install timm")


def hf_model_file(spec: str, hf_class: str | None = None) -> Path:
    """The generated model file for ``--hf spec`` (found, checked and written; see the module docstring)."""
    source = find_hf_config(spec, hf_class)
    require_transformers(source)
    return write_hf_model_file(source)


def generated_model_file(path: str | Path) -> tuple[str, str] | None:
    """``(file name, text)`` of ``path`` when it is a model file :func:`write_hf_model_file` wrote, else None:
    the exports put it beside train.py (which finds it there by name), so the plan folder is self-contained."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return (Path(path).name, text) if text.startswith(f'"""{GENERATED_MARK} ') else None
