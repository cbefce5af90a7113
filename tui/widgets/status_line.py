"""One line saying where the planning run is (profiling, searching n of N, done, failed)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static


def status_text(status: Any, error: str | None) -> Text:
    """``status``: the app's RunStatus."""
    if error:
        return Text(f"✗ {error}", style="bold red")
    phase = status.phase
    if phase == "done":
        return Text(f"✓ done: {status.message}", style="green")
    if phase == "cancelled":
        return Text("stopped", style="yellow")
    count = f" {status.done}/{status.total}" if status.total else ""
    return Text(f"… {phase}{count} {status.message}".rstrip(), style="yellow")


class StatusLine(Static):
    """Watches the app's ``status`` and ``error``."""

    def on_mount(self) -> None:
        self.watch(self.app, "status", self._refresh_status)
        self.watch(self.app, "error", self._refresh_status)

    def _refresh_status(self, _value: object = None) -> None:
        self.update(status_text(self.app.status, self.app.error))  # type: ignore[attr-defined]
