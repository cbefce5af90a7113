"""The model-file contract: find the model, its inputs, its loss and its defaults in a user's file.

Runs in the profiler child process (it imports user code). A model file is ordinary Python; optplan
looks for, in order:

1. ``build_model() -> nn.Module``, with optional ``example_batch(batch_size, seq_len) -> inputs``,
   ``loss_fn(output, batch) -> Tensor`` and ``OPTPLAN = {...}`` defaults;
2. a module-level ``nn.Module`` instance, or an ``nn.Module`` subclass defined in that file whose
   constructor takes no arguments. Instances win over classes; a class that is only a part (a
   submodule type) of another candidate is not a candidate. Several candidates are an error asking
   for ``--model-name NAME`` (``model_name`` may also name a builder function).

Inputs: a Tensor batch calls ``model(x)``, a tuple/list ``model(*x)``, a dict ``model(**x)``.
Without ``example_batch``, a model whose first parameterised module is an ``nn.Embedding`` gets a
batch of token ids ``[B, S]`` (dtype long, values below ``num_embeddings``); other models are an error
naming ``example_batch`` as the fix. Without ``loss_fn`` the loss is taken from the output (a scalar
tensor; ``output["loss"]``; the first scalar tensor of a tuple/list/dict; ``output["logits"]``'s mean; else the
first tensor's ``.float().mean()``), and a note says which rule was used (and names the trainable parameters the
loss leaves without a gradient, if any).

``OPTPLAN`` is read as data after the import (nothing in it is executed or evaluated): ``seq_len``,
``global_batch`` (positive ints), ``tokens`` (a number, or a string such as ``"2e12"``),
``optimizer`` and ``precision`` (names from :data:`OPTPLAN_NAMES`); other keys with scalar values go to
``extra`` (non-scalar ones are skipped with a note; one spelled close to a key optplan reads, such as
``precison``, gets a note too). A non-dict ``OPTPLAN`` is an error.

Every problem is raised as :class:`~optplan.probes.model_errors.ModelFileError` (one line: file, problem,
fix; re-exported by ``optplan.probes.loader``).

This module imports only torch and the pydantic-free ``optplan.probes.model_errors``: the runtime probe
child (``optplan.probes.runtime_child``) uses it in environments without the planner's dependencies.
``ModelDefaults`` (pydantic) is imported lazily by :func:`read_defaults`; with ``plain=True``, or when
pydantic is not installed, the defaults are a :class:`PlainDefaults` with the same fields.
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from optplan.probes.model_errors import ModelFileError, check_model_path, one_line
from optplan.probes.trainloop import (  # noqa: F401 - re-exported
    call_model,
    default_loss,
    first_param_module,
    first_tensor,
    forward_arity,
)

if TYPE_CHECKING:
    from optplan.estimators.profile import ModelDefaults

BUILDER = "build_model"
BATCH_FN = "example_batch"
LOSS_FN = "loss_fn"
DEFAULTS = "OPTPLAN"
DEFAULT_TOKEN_SEQ_LEN = 1024

_MODEL_FIX = ("define `def build_model(): return MyModel()` in the file (or a module-level nn.Module "
              "instance, or an nn.Module class whose constructor takes no arguments)")
BATCH_FIX = ("make example_batch(batch_size, seq_len) return what forward takes (a tensor calls "
              "model(x), a tuple/list model(*x), a dict model(**x): return (d,) for a forward that takes one dict)")



PIP_NAMES: dict[str, str] = {
    "cv2": "opencv-python", "sklearn": "scikit-learn", "PIL": "pillow", "yaml": "pyyaml",
    "skimage": "scikit-image", "bs4": "beautifulsoup4", "Crypto": "pycryptodome", "attr": "attrs",
    "google": "the matching google-* package", "dateutil": "python-dateutil", "serial": "pyserial",
}
"""Import names whose PyPI distribution has another name (so the hint never suggests a look-alike)."""

def exc_text(exc: BaseException) -> str:
    """``"TypeName: message"`` on one line."""
    msg = one_line(exc, 240)
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


# ---------------------------------------------------------------------------------------------------
# importing the file
# ---------------------------------------------------------------------------------------------------
def import_model_file(path: str | Path, display: str | None = None) -> ModuleType:
    """Import the file at ``path`` as a fresh module (its folder goes first on ``sys.path``)."""
    shown = display or str(path)
    p = check_model_path(path)
    mod_name = f"optplan_user_model_{abs(hash(str(p))):x}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(shown, "cannot be imported as a Python module",
                             "pass the .py file that defines build_model() or your nn.Module")
    module = importlib.util.module_from_spec(spec)
    folder = str(p.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up while it runs
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(mod_name, None)
        where = f"line {exc.lineno}" if exc.lineno else "unknown line"
        other = exc.filename and Path(exc.filename).resolve() != p
        in_file = f" in {exc.filename}" if other else ""
        raise ModelFileError(shown, f"syntax error at {where}{in_file}: {exc.msg}",
                             f"fix the syntax at {where}{in_file} (`python -m py_compile {exc.filename or shown}` "
                             "shows it)") from None
    except ModuleNotFoundError as exc:
        sys.modules.pop(mod_name, None)
        missing = (exc.name or str(exc)).split(".")[0]
        dist = PIP_NAMES.get(missing)
        install = (f"install the package that provides '{missing}' ({dist} on PyPI)" if dist
                   else f"install the package that provides '{missing}' (often `pip install {missing}`)")
        raise ModelFileError(shown, f"imports the missing package {missing!r} ({exc_text(exc)})",
                             f"{install} into {sys.executable}, or remove the import") from None
    except SystemExit as exc:
        sys.modules.pop(mod_name, None)
        raise ModelFileError(shown, f"the file exits when imported (SystemExit: {exc.code})",
                             "put script code under `if __name__ == \"__main__\":`") from None
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise ModelFileError(shown, f"importing the file raised {exc_text(exc)}",
                             f"make `python {shown}` run cleanly; put script code under "
                             "`if __name__ == \"__main__\":`") from None
    return module


# ---------------------------------------------------------------------------------------------------
# OPTPLAN defaults
# ---------------------------------------------------------------------------------------------------
_SCALARS = (str, int, float, bool, type(None))
OPTPLAN_KEYS = ("seq_len", "global_batch", "tokens", "optimizer", "precision", "name")
"""The ``OPTPLAN`` keys optplan reads; any other scalar key is the model file's own setting (``extra``), and one
spelled close to these gets a note."""
OPTPLAN_NAMES: dict[str, tuple[str, ...]] = {
    "optimizer": ("adamw", "adamw8bit", "adafactor", "sgd", "paged_adamw", "paged_adamw8bit"),
    "precision": ("fp32", "amp-bf16", "amp-fp16", "bf16", "fp16", "bf16-pure", "fp8"),
}
"""The names ``OPTPLAN["optimizer"]``/``["precision"]`` may take: ``estimators.strategy``'s OptimizerName and
PrecisionName (spelled out: this module runs where pydantic may be missing)."""


def _positive_int(shown: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelFileError(shown, f"OPTPLAN[{key!r}] must be a positive integer, got {value!r}",
                             f"write OPTPLAN[{key!r}] as a whole number such as 2048")
    return value


@dataclass(frozen=True)
class PlainDefaults:
    """``ModelDefaults``' fields without pydantic (the runtime probe child uses these)."""

    seq_len: int | None = None
    global_batch: int | None = None
    tokens: float | None = None
    optimizer: str | None = None
    precision: str | None = None
    extra: dict[str, str | int | float | bool | None] = field(default_factory=dict)


def _defaults(plain: bool, **values: Any) -> ModelDefaults | PlainDefaults:
    if not plain:
        try:
            from optplan.estimators.profile import ModelDefaults
        except ImportError:  # pydantic not installed: a bare training environment
            pass
        else:
            return ModelDefaults(**values)
    return PlainDefaults(**values)


def read_defaults(module: ModuleType, display: str, *, plain: bool = False
                  ) -> tuple[ModelDefaults | PlainDefaults, list[str]]:
    """The file's ``OPTPLAN`` dict as ModelDefaults (plus notes about skipped keys).

    ``plain``: return a :class:`PlainDefaults` and never import pydantic (also the fallback when
    pydantic is not installed). Validation and errors are the same either way.
    """
    raw = getattr(module, DEFAULTS, None)
    if raw is None:
        return _defaults(plain), []
    if not isinstance(raw, Mapping):
        raise ModelFileError(display, f"OPTPLAN must be a dict, got {type(raw).__name__}",
                             'write OPTPLAN = {"seq_len": 2048, "global_batch": 256, ...} or remove it')
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    notes: list[str] = []
    for key, value in raw.items():
        if not isinstance(key, str):
            notes.append(f"OPTPLAN key {key!r} is not a string and was ignored")
            continue
        if key in ("seq_len", "global_batch"):
            values[key] = None if value is None else _positive_int(display, key, value)
        elif key == "tokens":
            if value is None:
                values[key] = None
                continue
            try:
                if isinstance(value, bool):
                    raise ValueError
                number = float(value)
            except (TypeError, ValueError):
                raise ModelFileError(display, f"OPTPLAN['tokens'] must be a number, got {value!r}",
                                     "write the token budget as a number such as 2e12") from None
            if not number > 0:
                raise ModelFileError(display, f"OPTPLAN['tokens'] must be positive, got {value!r}",
                                     "write the token budget as a number such as 2e12")
            values[key] = number
        elif key in ("optimizer", "precision"):
            if value is not None and not isinstance(value, str):
                raise ModelFileError(display, f"OPTPLAN[{key!r}] must be a string, got {value!r}",
                                     f'write OPTPLAN[{key!r}] as a name such as "adamw" / "bf16"')
            names = OPTPLAN_NAMES[key]
            if value is not None and value not in names:  # a name, never evaluated
                raise ModelFileError(display, f"OPTPLAN[{key!r}] is {value!r}, not a known {key}",
                                     f"write one of {', '.join(names)}")
            values[key] = value
        elif isinstance(value, _SCALARS):
            extra[key] = value
            close = difflib.get_close_matches(key, OPTPLAN_KEYS, n=1, cutoff=0.8)
            if close and key not in OPTPLAN_KEYS:
                notes.append(f"OPTPLAN[{key!r}] is not a key optplan reads (did you mean {close[0]!r}?): it is "
                             f"kept as a setting of the model file only")
        else:
            notes.append(f"OPTPLAN[{key!r}] is a {type(value).__name__}, not a scalar, and was ignored")
    return _defaults(plain, **values, extra=extra), notes


# ---------------------------------------------------------------------------------------------------
# finding the model
# ---------------------------------------------------------------------------------------------------
@dataclass
class ModelContract:
    """What the file provides. ``builder`` returns a fresh model; call it via :func:`build_meta`."""

    path: Path
    display: str
    module: ModuleType
    source: str  # e.g. "build_model()", "instance model", "class Net"
    builder: Callable[[], Any]
    example_batch: Callable[[int, int], Any] | None
    loss_fn: Callable[[Any, Any], Any] | None
    defaults: ModelDefaults | PlainDefaults
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The model's name: ``OPTPLAN["name"]`` when a string, else the file's stem."""
        name = self.defaults.extra.get("name")
        return name if isinstance(name, str) and name else self.path.stem

    def build_meta(self) -> nn.Module:
        """Build the model on the meta device (no real weights); errors become ModelFileError."""
        return build_meta(self.builder, self.source, self.display)

    def build_real(self) -> nn.Module:
        """Build the model on the CPU with real weights (see :func:`build_real`)."""
        return build_real(self.builder, self.source, self.display)


def _no_arg_constructible(obj: Callable[..., Any]) -> bool:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in sig.parameters.values()
    )


def apply_keeping_ties(model: nn.Module, fn: Callable[[nn.Module], Any]) -> nn.Module:
    """Run ``fn(model)`` (``to_empty``, ``to("meta")``...) and re-tie parameters and buffers that were
    shared before: moving between device types creates one new Parameter per owning module."""
    tables: dict[str, dict[int, list[tuple[nn.Module, str]]]] = {"_parameters": {}, "_buffers": {}}
    for mod in model.modules():
        for store, table in tables.items():
            for name, t in getattr(mod, store).items():
                if t is not None:
                    table.setdefault(id(t), []).append((mod, name))
    fn(model)
    for store, table in tables.items():
        for refs in table.values():
            if len(refs) > 1:
                first = getattr(refs[0][0], store)[refs[0][1]]
                for mod, name in refs[1:]:
                    getattr(mod, store)[name] = first
    return model


def _instance_builder(instance: nn.Module) -> Callable[[], nn.Module]:
    state: dict[str, nn.Module] = {}

    def build() -> nn.Module:
        if "meta" not in state:  # move the file's instance to meta once (frees its real weights)
            state["meta"] = apply_keeping_ties(instance, lambda m: m.to("meta"))
        return copy.deepcopy(state["meta"])

    return build


def _callable_for(display: str, name: str, obj: Any) -> tuple[str, Callable[[], Any]]:
    if isinstance(obj, nn.Module):
        return f"instance {name}", _instance_builder(obj)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        if not _no_arg_constructible(obj):
            raise ModelFileError(display, f"class {name} needs constructor arguments",
                                 f"give {name}.__init__ defaults, or add build_model() that constructs it")
        return f"class {name}", obj
    if callable(obj):
        return f"{name}()", obj
    raise ModelFileError(display, f"{name} is a {type(obj).__name__}, not a model",
                         "--model-name must name an nn.Module instance, class, or a function returning one")


def _candidates(module: ModuleType) -> tuple[dict[str, nn.Module], dict[str, type]]:
    instances: dict[str, nn.Module] = {}
    seen: set[int] = set()
    classes: dict[str, type] = {}
    for name, obj in vars(module).items():
        if name.startswith("__"):
            continue
        if isinstance(obj, nn.Module):
            if id(obj) not in seen:
                seen.add(id(obj))
                instances[name] = obj
        elif (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
              and not inspect.isabstract(obj) and _no_arg_constructible(obj)):
            classes[name] = obj
    # an instance that is a submodule of another instance is a part, not a model
    parts = {id(m) for inst in instances.values() for m in list(inst.modules())[1:]}
    instances = {n: m for n, m in instances.items() if id(m) not in parts}
    return instances, classes


def _drop_part_classes(classes: dict[str, type], display: str) -> dict[str, type]:
    """Drop classes whose instances appear inside another candidate class's model (built on meta)."""
    if len(classes) < 2:
        return classes
    used_inside: set[type] = set()
    for cls in classes.values():
        try:
            with torch.device("meta"):
                model = cls()
        except Exception:  # noqa: BLE001 - a class that cannot be built is judged later, if chosen
            continue
        used_inside.update(type(m) for m in list(model.modules())[1:])
        del model
    kept = {n: c for n, c in classes.items() if c not in used_inside}
    return kept or classes


def resolve_contract(module: ModuleType, path: str | Path, *, model_name: str | None = None,
                     display: str | None = None, plain_defaults: bool = False) -> ModelContract:
    """Find the model builder, example batch, loss and defaults in an imported model file
    (``plain_defaults``: see :func:`read_defaults`)."""
    shown = display or str(path)
    defaults, notes = read_defaults(module, shown, plain=plain_defaults)
    batch_fn = getattr(module, BATCH_FN, None)
    loss = getattr(module, LOSS_FN, None)
    for fn_name, fn in ((BATCH_FN, batch_fn), (LOSS_FN, loss)):
        if fn is not None and not callable(fn):
            raise ModelFileError(shown, f"{fn_name} is a {type(fn).__name__}, not a function",
                                 f"define {fn_name} as a function or remove it")

    if model_name is not None:
        if not hasattr(module, model_name):
            instances, classes = _candidates(module)
            found = sorted({BUILDER} & set(vars(module)) | set(instances) | set(classes))
            hint = f"use one of: {', '.join(found)}" if found else _MODEL_FIX
            raise ModelFileError(shown, f"--model-name {model_name}: the file has no such name", hint)
        source, builder = _callable_for(shown, model_name, getattr(module, model_name))
    elif hasattr(module, BUILDER):
        fn = getattr(module, BUILDER)
        if not callable(fn):
            raise ModelFileError(shown, f"build_model is a {type(fn).__name__}, not a function",
                                 "define `def build_model(): return MyModel()`")
        source, builder = f"{BUILDER}()", fn
    else:
        instances, classes = _candidates(module)
        if instances:
            pool: dict[str, Any] = instances
            kind = "nn.Module instances"
        else:
            pool = _drop_part_classes(classes, shown)
            kind = "nn.Module classes with no-argument constructors"
        if not pool:
            raise ModelFileError(shown, "no model found (no build_model(), no module-level nn.Module "
                                 "instance, no nn.Module class with a no-argument constructor)", _MODEL_FIX)
        if len(pool) > 1:
            names = sorted(pool)
            raise ModelFileError(shown, f"several models found ({kind}: {', '.join(names)})",
                                 f"choose one with --model-name {names[0]} (or define build_model())")
        name, obj = next(iter(pool.items()))
        source, builder = _callable_for(shown, name, obj)
        notes.append(f"model from {source} (no build_model() in the file)")
    return ModelContract(path=Path(path).resolve(), display=shown, module=module, source=source,
                         builder=builder, example_batch=batch_fn, loss_fn=loss, defaults=defaults,
                         notes=notes)


def load_contract(path: str | Path, *, model_name: str | None = None, plain_defaults: bool = False) -> ModelContract:
    """Import the file and resolve its contract (in the current process: call it in a child).

    ``plain_defaults``: the defaults are a :class:`PlainDefaults` and pydantic is never imported.
    """
    module = import_model_file(path, display=str(path))
    return resolve_contract(module, path, model_name=model_name, display=str(path), plain_defaults=plain_defaults)


def build_meta(builder: Callable[[], Any], source: str, display: str) -> nn.Module:
    """``builder()`` under ``torch.device("meta")``; ModelFileError when it raises or returns no Module."""
    try:
        with torch.device("meta"):
            model = builder()
    except ModelFileError:
        raise
    except Exception as exc:
        if _network_error(exc):
            raise ModelFileError(display, f"{source} tried to download over the network and failed ({exc_text(exc)})",
                                 f"download the weights beforehand and load them outside {source} (optplan only "
                                 "needs the architecture: build it without pretrained weights)") from None
        if _out_of_memory(exc):
            raise ModelFileError(display, f"{source} ran out of host memory ({exc_text(exc)}): the model is too "
                                 "large to build here, even on the meta device",
                                 f"create no tensors with an explicit device='cpu' in {source} (optplan builds on "
                                 "the meta device), or pass --arch/--params to plan it by shape") from None
        fix = getattr(exc, "fix", None)
        if isinstance(fix, str) and fix:  # the file says what to do (e.g. the model file --hf writes)
            raise ModelFileError(display, f"{source} raised {exc_text(exc)}", fix) from None
        raise ModelFileError(display, f"{source} raised {exc_text(exc)}",
                             f"make {source} run with no arguments; optplan calls it under "
                             "`with torch.device('meta')`, so it must not need real weights or values "
                             "(no .item(), no torch.load)") from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(display, f"{source} returned {type(model).__name__}, not a torch.nn.Module",
                             f"return the model (an nn.Module instance) from {source}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(display, "the model has no trainable parameters (every parameter has "
                             "requires_grad=False, or there are none), so there is nothing to train",
                             f"leave at least one parameter trainable in {source} (e.g. do not freeze the adapter "
                             "or the head)")
    return model


def build_real(builder: Callable[[], Any], source: str, display: str) -> nn.Module:
    """``builder()`` on the CPU with real, initialised weights (the profile's fallback for a forward that
    needs tensor values; the caller checks the size first); ModelFileError when it raises."""
    try:
        with torch.device("cpu"):
            model = builder()
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(display, f"{source} raised {exc_text(exc)} when built on the CPU for a real run",
                             f"make {source} build the model on the CPU too") from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(display, f"{source} returned {type(model).__name__}, not a torch.nn.Module",
                             f"return the model (an nn.Module instance) from {source}")
    return model


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (a few levels)."""
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8 and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def _network_error(exc: BaseException) -> bool:
    """A failed download: a refused/unreachable connection, a DNS failure, an HTTP error (urllib, requests,
    huggingface_hub raise subclasses of these or name them so)."""
    import socket
    import urllib.error

    for e in _causes(exc):
        if isinstance(e, (urllib.error.URLError, ConnectionError, socket.gaierror, socket.timeout)):
            return True
        names = {c.__name__ for c in type(e).__mro__}
        if names & {"ConnectionError", "HTTPError", "ConnectTimeout", "ReadTimeout", "MaxRetryError",
                    "NewConnectionError", "LocalEntryNotFoundError", "OfflineModeIsEnabled"}:
            return True
    return False


def _out_of_memory(exc: BaseException) -> bool:
    return any(isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "not enough memory" in str(e)
               for e in _causes(exc))


# ---------------------------------------------------------------------------------------------------
# inputs, forward and loss
# ---------------------------------------------------------------------------------------------------
def check_batch_type(batch: Any, display: str, where: str) -> None:
    """ModelFileError unless ``batch`` is a tensor, tuple/list or dict holding a tensor."""
    if not isinstance(batch, (torch.Tensor, Mapping, list, tuple)):
        raise ModelFileError(display, f"{where} returned {type(batch).__name__}, not a tensor, tuple, list or dict",
                             BATCH_FIX)
    if first_tensor(batch) is None:
        raise ModelFileError(display, f"{where} returned no tensor", BATCH_FIX)
