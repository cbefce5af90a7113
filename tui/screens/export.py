"""Export: pick targets, preview each file (validated by its trainer's own loader), write them.

Rendering imports DeepSpeed, accelerate, transformers and Lightning to validate: it runs in a thread
worker. Writing is atomic (all or nothing) and never overwrites without a yes in the confirm modal
(``--force`` on the command line answers yes in advance).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rich.syntax import Syntax
from rich.text import Text
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Input, Label, OptionList, SelectionList, Static
from textual.worker import get_current_worker

from optplan.estimators.errors import OptplanError
from optplan.planner.api import EXPORT_TARGETS, existing_exports, render_exports, write_exports
from optplan.planner.recommend import Recommendation
from optplan.tui.screens.base import DashboardScreen
from optplan.tui.screens.confirm import ConfirmScreen

LEXERS = {".json": "json", ".yaml": "yaml", ".yml": "yaml", ".sh": "bash", ".sbatch": "bash", ".md": "markdown"}
TARGET_LABELS = {"deepspeed": "DeepSpeed ds_config.json", "accelerate": "accelerate.yaml",
                 "torchrun": "launch.sh", "slurm": "slurm.sbatch", "hf": "HF TrainingArguments",
                 "lightning": "Lightning Trainer", "train": "train.py (the training loop)",
                 "finetune": "finetune.py (LoRA with TRL)"}
DEFAULT_OUT = "plan"


def preview(name: str, text: str) -> Syntax:
    """A file with syntax highlighting chosen by its suffix."""
    return Syntax(text, LEXERS.get(Path(name).suffix, "text"), theme="monokai", line_numbers=True,
                  word_wrap=False, background_color="default")


class Rendered(Message):
    """The files of one rendering (or the error that stopped it)."""

    def __init__(self, generation: int, files: dict[str, str], skipped: list[str], error: str | None) -> None:
        super().__init__()
        self.generation = generation
        self.files = files
        self.skipped = skipped
        self.error = error


class ExportScreen(DashboardScreen):
    MODE = "export"
    BINDINGS = [Binding("w", "write", "Write files"), Binding("p", "render", "Preview")]

    def body(self) -> Iterable[Widget]:
        with Horizontal(id="export-top"):
            yield SelectionList[str](*[(TARGET_LABELS[t], t, True) for t in EXPORT_TARGETS], id="export-targets")
            with Vertical(id="export-controls"):
                yield Static(id="export-plan")
                with Horizontal(id="export-out-row"):
                    yield Label("folder")
                    yield Input(id="export-out")
                    yield Button("Write (w)", id="export-write", variant="primary")
                yield Static(id="export-status")
        with Horizontal(id="export-main"):
            yield OptionList(id="export-files")
            with VerticalScroll(id="export-preview-box"):
                yield Static(id="export-preview")

    def on_mount(self) -> None:
        self.files: dict[str, str] = {}
        self._generation = 0
        args = self.dash.prepared.args
        self.query_one("#export-out", Input).value = str(args.out) if args.out is not None else DEFAULT_OUT
        self.watch(self.app, "result", self._result_changed)

    # --- rendering (thread worker) -------------------------------------------------------------------

    def _recommendation(self) -> Recommendation | None:
        result = self.dash.result
        return result.recommendation if result is not None else None

    def _targets(self) -> tuple[str, ...]:
        chosen = tuple(self.query_one("#export-targets", SelectionList).selected)
        return ("all",) if set(chosen) == set(EXPORT_TARGETS) else chosen

    def _result_changed(self, _value: object = None) -> None:
        rec = self._recommendation()
        plan = self.query_one("#export-plan", Static)
        if rec is None:
            plan.update(Text("no plan yet: the search is running", style="dim"))
            self._show_files({}, [], None)
        elif not rec.fits or rec.plan is None:
            plan.update(Text("no plan fits, so there is nothing to export", style="bold red"))
            self._show_files({}, [], None)
        else:
            plan.update(Text.assemble("exporting the chosen plan: ", (rec.plan.label(), "bold green")))
            self.action_render()

    def on_selection_list_selected_changed(self, _event: SelectionList.SelectedChanged[str]) -> None:
        if self._recommendation() is not None:
            self.action_render()

    def action_render(self) -> None:
        rec = self._recommendation()
        if rec is None or rec.plan is None:
            return
        targets = self._targets()
        self._generation += 1
        self.files = {}
        self.query_one("#export-status", Static).update(
            Text("rendering and validating with each trainer's own loader…", style="yellow"))
        self.run_worker(lambda g=self._generation: self._render_in_thread(g, rec, targets), thread=True,
                        exclusive=True, group="export", exit_on_error=False)

    def _render_in_thread(self, generation: int, rec: Recommendation, targets: tuple[str, ...]) -> None:
        if not targets:
            self.post_message(Rendered(generation, {}, [], "pick at least one target"))
            return
        try:
            files, skipped = render_exports(rec, targets, self.dash.prepared.export_options)
        except OptplanError as err:
            files, skipped, error = {}, [], str(err)
        else:
            error = None
        if not get_current_worker().is_cancelled:
            self.post_message(Rendered(generation, files, skipped, error))

    def on_rendered(self, message: Rendered) -> None:
        if message.generation == self._generation:
            self._show_files(message.files, message.skipped, message.error)

    def _show_files(self, files: dict[str, str], skipped: list[str], error: str | None) -> None:
        self.files = files
        names = self.query_one("#export-files", OptionList)
        names.clear_options()
        names.add_options(list(files))
        status = self.query_one("#export-status", Static)
        if error is not None:
            status.update(Text(f"✗ {error}", style="bold red"))
        elif files:
            text = Text(f"✓ {len(files)} files rendered; each launch config accepted by its trainer's own loader",
                        style="green")
            for why in skipped:
                text.append(f"\nnot written: {why}", style="dim")
            status.update(text)
        else:
            status.update("")
        if files:
            names.highlighted = 0
            first = next(iter(files))
            self.query_one("#export-preview", Static).update(preview(first, files[first]))
        else:
            self.query_one("#export-preview", Static).update("")

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        name = str(event.option.prompt)
        if name in self.files:
            self.query_one("#export-preview", Static).update(preview(name, self.files[name]))

    # --- writing ---------------------------------------------------------------------------------------

    def _out_dir(self) -> Path:
        return Path(self.query_one("#export-out", Input).value.strip() or DEFAULT_OUT)

    def action_write(self) -> None:
        status = self.query_one("#export-status", Static)
        if not self.files:
            status.update(Text("nothing to write yet (no plan, or the files are still rendering)", style="yellow"))
            return
        out = self._out_dir()
        existing = existing_exports(out, list(self.files))
        if existing and not self.dash.prepared.args.force:
            question = f"{out} already has {', '.join(existing)}.\nOverwrite them?"
            self.app.push_screen(ConfirmScreen(question), lambda yes: self._write(out, force=bool(yes), asked=True))
            return
        self._write(out, force=bool(existing))

    def _write(self, out: Path, *, force: bool, asked: bool = False) -> None:
        status = self.query_one("#export-status", Static)
        if asked and not force:
            status.update(Text("nothing written: the existing files are kept", style="yellow"))
            return
        try:
            written = write_exports(out, self.files, force=force)
        except OptplanError as err:
            status.update(Text(f"✗ {err}", style="bold red"))
            return
        status.update(Text(f"✓ wrote {len(written)} files to {out}: " + ", ".join(p.name for p in written),
                           style="green"))
        self.notify(f"wrote {len(written)} files to {out}", title="export")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "export-write":
            self.action_write()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self.action_write()
