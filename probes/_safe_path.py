"""Keep the working folder off a child's ``sys.path``.

``python -m MODULE`` puts the folder optplan was started from first on ``sys.path``, so a stray
``numpy.py`` there would be imported by torch in a child. Children are started with
``PYTHONSAFEPATH=1``, which stops that on Python >= 3.11; on 3.10 each child calls
:func:`drop_working_folder` before importing anything else (this module imports only the standard
library). An ``optplan/`` folder in the working folder still shadows the package on 3.10, since ``-m``
resolves the module before any of its code runs.
"""

from __future__ import annotations

import os
import sys


def drop_working_folder() -> None:
    """Remove the working folder that ``python -m`` put first on ``sys.path`` (a no-op under safe_path)."""
    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
