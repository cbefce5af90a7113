"""What every dashboard screen has: header, screen tabs, the run's status line, footer with the keys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header

from optplan.tui.widgets.nav_bar import NavBar
from optplan.tui.widgets.status_line import StatusLine

if TYPE_CHECKING:
    from optplan.tui.app import DashboardApp


class DashboardScreen(Screen[None]):
    """A screen of the dashboard; subclasses give ``MODE`` and ``body``."""

    MODE: ClassVar[str] = ""

    @property
    def dash(self) -> DashboardApp:
        return cast("DashboardApp", self.app)

    def compose(self) -> ComposeResult:
        yield Header()
        yield NavBar(self.MODE)
        yield StatusLine(classes="status")
        yield from self.body()
        yield Footer()

    def body(self) -> Iterable[Widget]:
        """The screen's own widgets between the status line and the footer (each screen gives its own)."""
        return ()
