"""Overview: the model, the cluster, the objective and constraints; inputs to edit and re-plan."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Button, Input, Label, Select, Static

from optplan.estimators.errors import OptplanError
from optplan.estimators.hardware import Cluster
from optplan.estimators.profile import ModelProfile
from optplan.tui.fmt import long_duration, si
from optplan.tui.recommend_args import RecommendArgs
from optplan.tui.recommend_run import PreparedRecommend
from optplan.tui.screens.base import DashboardScreen
from optplan.tui.widgets.key_values import KeyValues

OBJECTIVES = ("throughput", "time", "cost")


def model_rows(p: ModelProfile | None, args: RecommendArgs) -> list[tuple[str, str]]:
    if p is None:
        what = (str(args.model) if args.model is not None else f"--hf {args.hf}" if args.hf is not None
                else f"--arch {args.arch}" if args.arch else f"--params {args.params:g}" if args.params is not None
                else "(no model)")
        return [("model", what), ("", "profiling…")]
    rows = [("model", f"{p.name} ({p.model_class})"), ("from", p.path),
            ("parameters", f"{p.params:,} ({p.trainable_params:,} trainable)")]
    if p.tokens_per_sample:
        rows.append(("FLOPs/token", f"{si(p.train_flops_per_sample / p.tokens_per_sample)} fwd+bwd"))
    if p.train_flops_per_sample:
        rows.append(("FLOPs/sample", f"{si(p.train_flops_per_sample)} fwd+bwd"))
    if p.repeated_block is not None:
        rb = p.repeated_block
        rows.append(("repeated block", f"{rb.count} x {rb.class_name} ({rb.params_per_block:,} params each)"))
    if p.transformer is not None:
        t = p.transformer
        rows.append(("shape", f"hidden {t.hidden}, layers {t.layers}, heads {t.heads}"
                     + (f", kv heads {t.kv_heads}" if t.kv_heads else "") + (f", vocab {t.vocab}" if t.vocab else "")))
    rows.append(("input", p.input_kind + (f", {p.tokens_per_sample} tokens/sample" if p.tokens_per_sample else "")))
    if p.activations:
        acts = ", ".join(f"{a.precision}{'' if a.checkpointing == 'none' else ' ' + a.checkpointing + ' ckpt'} "
                         f"{a.per_sample_bytes / 2**20:,.1f}" for a in p.activations)
        rows.append(("activations", f"MiB/sample: {acts}"))
    return rows


def cluster_rows(c: Cluster, notes: Iterable[str]) -> list[tuple[str, str]]:
    g = c.gpu
    peak = max(g.peak_flops.get("bf16", 0.0), g.peak_flops.get("fp16", 0.0))
    rows = [("GPU", f"{g.name}, {g.memory_bytes / 2**30:.0f} GiB, {peak / 1e12:,.0f} TFLOP/s 16-bit"),
            ("GPUs", f"{c.gpus} ({c.nodes} node(s) of {c.gpus_per_node})"),
            ("source", "detected (NVML)" if c.detected else "target (not detected here)"),
            ("intra-node", f"{g.intra_node_link} {g.intra_node_bandwidth_bytes_per_s / 1e9:,.0f} GB/s per GPU"),
            ("inter-node", f"{c.inter_node_bandwidth_bytes_per_s / 1e9:,.0f} GB/s per GPU")]
    if c.price_per_gpu_hour is not None:
        rows.append(("price", f"${c.price_per_gpu_hour:g} per GPU-hour"))
    rows += [("note", n) for n in notes]
    return rows


def objective_rows(prepared: PreparedRecommend, profile: ModelProfile | None) -> list[tuple[str, str]]:
    a, goal = prepared.args, prepared.goal
    gb = a.global_batch if a.global_batch is not None else (
        f"{a.global_batch_tokens:g} tokens" if a.global_batch_tokens is not None else None)
    if gb is None and profile is not None and profile.defaults.global_batch:
        gb = f"{profile.defaults.global_batch} (model file's OPTPLAN)"
    seq = a.seq_len or (profile.seq_len if profile is not None else None)
    rows = [("objective", goal.objective), ("global batch", str(gb) if gb is not None else "free"),
            ("sequence length", str(seq) if seq else "-")]
    if goal.tokens is not None:
        rows.append(("tokens", f"{goal.tokens:.3g}"))
    if goal.price_per_gpu_hour is not None:
        rows.append(("price", f"${goal.price_per_gpu_hour:g} per GPU-hour"))
    if goal.deadline_s is not None:
        rows.append(("deadline", long_duration(goal.deadline_s)))
    if prepared.gpu_counts:
        rows.append(("GPU counts", ", ".join(map(str, prepared.gpu_counts))))
    for name, values in (("precisions", a.precision), ("optimizers", a.optimizer), ("engines", a.engine)):
        rows.append((name, ", ".join(values) if values else "default"))
    rows.append(("offload", "searched" if a.offload else "off (--no-offload)"))
    rows.append(("method", f"{a.method}, seed {a.seed}"))
    if prepared.storage is not None:
        rows.append(("study", "kept in the --out/--storage file (resumable)"))
    return rows


def _int_or_none(field: str, text: str) -> int | None:
    text = text.strip().replace(",", "").replace("_", "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise OptplanError(f"{field} must be a whole number (got {text!r})") from None


class OverviewScreen(DashboardScreen):
    MODE = "overview"
    AUTO_FOCUS = ""  # digits and q switch screens and quit until an input is clicked or tabbed to
    BINDINGS = [Binding("r", "replan", "Re-plan"), Binding("escape", "blur", "Leave input", show=False)]

    def body(self) -> Iterable[Widget]:
        with Horizontal(id="overview-panels"):
            yield KeyValues("model", id="model-panel")
            with Vertical(id="overview-right"):
                yield KeyValues("cluster", id="cluster-panel")
                yield KeyValues("objective and constraints", id="objective-panel")
        with Horizontal(id="inputs"):
            yield Label("GPUs")
            yield Input(id="in-gpus", placeholder="auto", type="integer")
            yield Label("global batch")
            yield Input(id="in-global-batch", placeholder="free", type="integer")
            yield Label("seq len")
            yield Input(id="in-seq-len", placeholder="model", type="integer")
            yield Label("objective")
            yield Select([(o, o) for o in OBJECTIVES], id="in-objective", allow_blank=False, value="throughput")
            yield Button("Re-plan (r)", id="replan", variant="primary")
        yield Static(id="input-error")

    def on_mount(self) -> None:
        self.watch(self.app, "profile", self._refresh_panels)
        self.watch(self.app, "result", self._refresh_panels)
        self._fill_inputs()

    def _fill_inputs(self) -> None:
        a = self.dash.prepared.args
        self.query_one("#in-gpus", Input).value = "" if a.gpus is None else str(a.gpus)
        self.query_one("#in-global-batch", Input).value = "" if a.global_batch is None else str(a.global_batch)
        self.query_one("#in-seq-len", Input).value = "" if a.seq_len is None else str(a.seq_len)
        self.query_one("#in-objective", Select).value = a.objective

    def _refresh_panels(self, _value: object = None) -> None:
        prepared = self.dash.prepared
        profile = self.dash.profile
        self.query_one("#model-panel", KeyValues).show(model_rows(profile, prepared.args))
        self.query_one("#cluster-panel", KeyValues).show(cluster_rows(prepared.cluster, prepared.notes))
        self.query_one("#objective-panel", KeyValues).show(objective_rows(prepared, profile))
        # an empty input keeps the model file's OPTPLAN global batch, not a free one: its placeholder says which
        file_batch = profile.defaults.global_batch if profile is not None else None
        self.query_one("#in-global-batch", Input).placeholder = f"{file_batch} (file)" if file_batch else "free"

    def edited_args(self) -> RecommendArgs:
        """The run's options with the edited inputs (OptplanError for text that is not a number)."""
        a = self.dash.prepared.args
        objective = self.query_one("#in-objective", Select).value
        return a.model_copy(update={
            "gpus": _int_or_none("GPUs", self.query_one("#in-gpus", Input).value),
            "global_batch": _int_or_none("global batch", self.query_one("#in-global-batch", Input).value),
            "global_batch_tokens": None if self.query_one("#in-global-batch", Input).value.strip()
            else a.global_batch_tokens,
            "seq_len": _int_or_none("seq len", self.query_one("#in-seq-len", Input).value),
            "objective": str(objective),
        })

    def action_replan(self) -> None:
        error = self.query_one("#input-error", Static)
        try:
            self.dash.replan(self.edited_args())
        except OptplanError as err:
            error.update(Text(f"✗ {err}", style="bold red"))
            return
        error.update(Text("re-planning with the edited inputs…", style="yellow"))
        self._refresh_panels()

    def action_blur(self) -> None:
        self.set_focus(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "replan":
            self.action_replan()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self.action_replan()
