"""The one exception type every optplan layer raises for problems a user can fix."""

from __future__ import annotations


class OptplanError(ValueError):
    """A user-fixable problem, carrying a one-line message that names the problem and the fix.

    Faces (the CLI, the dashboard) print ``str(error)`` on one line and exit with code 2; they never
    show a traceback for this type unless asked to (``--debug``).
    """

    exit_code: int = 2


class Cancelled(Exception):  # noqa: N818 - a state, not an error: the caller asked to stop
    """The caller cancelled the run (the dashboard quit or re-planned): every child process it started
    has been stopped before this is raised. Not a user error: faces stop quietly."""
