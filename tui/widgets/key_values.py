"""A titled panel of label/value rows (the Overview's model, cluster and objective)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text
from textual.widgets import Static


class KeyValues(Static):
    """Rows of (label, value); ``show`` replaces them."""

    DEFAULT_CSS = """
    KeyValues { height: auto; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = title

    def show(self, rows: Sequence[tuple[str, str]]) -> None:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for key, value in rows:
            table.add_row(Text(key), Text(value))  # plain text: paths and labels are not markup
        self.update(table)
