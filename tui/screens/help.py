"""``?``: the keys and what each screen shows."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS = (
    ("1 … 5", "Overview, Search, Plan, Export, Hardware"),
    ("r", "re-plan with the inputs edited on the Overview"),
    ("enter", "on a trial (Search): show it on the Plan screen (what if)"),
    ("c", "on the Plan screen: back to the chosen plan"),
    ("w", "on the Export screen: write the files (asks before overwriting)"),
    ("tab", "next field or table"),
    ("?", "this help"),
    ("q, ctrl+c", "quit (a search or probe in progress stops; with --out/--storage the study resumes on the next run)"),
)
SCREENS = (
    ("Overview", "the model, the cluster, the objective and constraints; edit GPUs, global batch, "
                 "sequence length and objective, then r"),
    ("Search", "progress, every priced candidate (trial), the best so far and the Pareto front, live"),
    ("Plan", "the chosen plan (or the selected trial): memory per GPU by category, step time, time to "
             "train and cost, and why"),
    ("Export", "pick launch-config targets, preview each file, write them (validated by each trainer's "
               "loader)"),
    ("Hardware", "live utilisation, memory, temperature and power per GPU (NVML)"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        keys = Table(title="keys", title_justify="left", show_header=False, box=None, padding=(0, 2))
        keys.add_column(style="bold cyan", no_wrap=True)
        keys.add_column()
        for k, what in KEYS:
            keys.add_row(k, what)
        screens = Table(title="screens", title_justify="left", show_header=False, box=None, padding=(0, 2))
        screens.add_column(style="bold", no_wrap=True)
        screens.add_column()
        for name, what in SCREENS:
            screens.add_row(name, what)
        with Vertical(id="help-box"):
            yield Static(keys)
            yield Static(screens)
            yield Static("escape or ? closes", classes="dim")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(result)
