"""The row of screen names under the header, the current one highlighted, and the run's status."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

SCREENS = (("1", "overview", "Overview"), ("2", "search", "Search"), ("3", "plan", "Plan"),
           ("4", "export", "Export"), ("5", "hardware", "Hardware"))


class NavBar(Static):
    """Tabs-like line: ' 1 Overview  2 Search ...' with ``current`` in reverse video."""

    def __init__(self, current: str) -> None:
        super().__init__(classes="nav")
        self.current = current

    def on_mount(self) -> None:
        text = Text()
        for key, mode, title in SCREENS:
            style = "bold reverse" if mode == self.current else ""
            text.append(f" {key} {title} ", style=style)
            text.append(" ")
        self.update(text)
