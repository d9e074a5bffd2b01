"""``refit clean-ipc`` as a user runs it, on the segments of real processes.

Where every refit process of a host was SIGKILLed nothing else would ever remove their
segments (the weights a host source staged, in plain form): the command removes those, and
only those, keeping a running process's; ``--dry-run`` lists them and removes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.ipc_owner import Owner, exists

ROOT = Path(__file__).resolve().parents[2]


def clean_ipc(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "refit.cli", "clean-ipc", *flags], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


@pytest.mark.timeout(240)
def test_clean_ipc_removes_a_sigkilled_owners_segments_and_keeps_a_running_ones():
    dead, alive = Owner("exit"), Owner("exit")
    try:
        dead.kill()
        listed = clean_ipc("--dry-run", "--verbose")
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        for name in dead.segments:
            assert any(line.startswith(f"would remove {name} ") and f"process {dead.pid} is gone" in line
                       for line in lines), listed.stdout
            assert exists(name)  # a dry run removes nothing
        for name in alive.segments:
            assert any(line.startswith(f"kept {name} ") and f"process {alive.pid} runs" in line for line in lines), \
                listed.stdout
        assert "would remove" in lines[-1] and "segment(s) of processes that are gone" in lines[-1]
        done = clean_ipc()
        assert done.returncode == 0, done.stderr
        assert all(f"removed {name} " in done.stdout for name in dead.segments), done.stdout
        assert not any(exists(n) for n in dead.segments)
        assert all(exists(n) for n in alive.segments)
        assert not any(name in done.stdout for name in alive.segments)
        assert alive.finish() == 0  # and its own exit removes them
        assert not any(exists(n) for n in alive.segments)
    finally:
        dead.close()
        alive.close()
