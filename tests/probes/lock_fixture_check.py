"""Run only by test_device_lock.py's ``test_a_gpu_test_run_beside_probes_holds_the_device_lock``, in a pytest of its
own with ``$OPTPLAN_DEVICE_LOCK`` and ``$OPTPLAN_TEST_LOCK_FILE`` set (the file name keeps it out of the suite's
collection): conftest's fixture must hold the lock around a test marked gpu, with the variable removed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from optplan.probes.device_lock import DEVICE_LOCK_ENV


@pytest.mark.gpu  # the marker conftest's lock fixture looks for; nothing here needs a GPU
def test_a_gpu_test_holds_the_lock_beside_probes() -> None:
    assert DEVICE_LOCK_ENV not in os.environ  # its own probes must not wait for this process
    try_lock = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
                "try: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError: sys.exit(3)")
    code = subprocess.run([sys.executable, "-c", try_lock, os.environ["OPTPLAN_TEST_LOCK_FILE"]]).returncode
    assert code == 3  # held by this test's process
