"""A process that owns refit IPC segments, for the tests of who removes them and when.

``Owner(mode)`` runs this file as ``python ipc_owner.py MODE``. It opens an ``IpcChannel`` (its control segment) and
binds an executor of a host source's plan, which stages the weight it sends in a segment, prints one
JSON line ``{"pid": ..., "segments": [names]}``, and waits for a line on stdin. Then, with
both left open (held until the interpreter ends):

* ``exit``: returns normally;
* ``raise``: ends on an uncaught exception;
* ``fork``: forks a child that exits normally (running the atexit hooks it inherited),
  prints ``{"after_fork": [exists, ...]}`` and waits for another line before returning.

A test SIGKILLs it while it waits, to leave segments no exit hook removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHM_DIR = "/dev/shm"
_HELD: list = []  # alive until the interpreter ends: nothing but the exit hooks removes the segments


def main(mode: str) -> None:
    import torch

    from refit import Replicate
    from refit.plan import RosterEntry, build_rank_plan, merge_rosters
    from refit.transport.ipc import IpcChannel, IpcExecutor

    # rank 0 (this process) sends a 128 x 128 weight whole to rank 1: its plan stages it in a segment
    roster = {r: [RosterEntry.make("w", (128, 128), "float32", [r], [Replicate()], role)]
              for r, role in ((0, "src"), (1, "dst"))}
    plan = build_rank_plan(merge_rosters(roster, 2), 0)
    channel = IpcChannel(0)
    executor = IpcExecutor(plan, channel)
    executor.prepare({"w": torch.full((128, 128), 7.0)}, {})
    _HELD.append((channel, executor))
    entry = channel.local_roster_entry()
    names = [entry.control, *(r[1] for r in entry.regions.values() if r[0] == "shm")]
    assert len(names) == 2, entry
    print(json.dumps({"pid": os.getpid(), "segments": names}), flush=True)
    sys.stdin.readline()
    if mode == "raise":
        raise RuntimeError("an uncaught exception, the channel left open")
    if mode == "fork":
        child = os.fork()
        if child == 0:
            sys.exit(0)
        os.waitpid(child, 0)
        print(json.dumps({"after_fork": [os.path.exists(os.path.join(SHM_DIR, n)) for n in names]}), flush=True)
        sys.stdin.readline()


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


class Owner:
    """This file in a process of its own, with the names of its segments."""

    def __init__(self, mode: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, __file__, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        info = json.loads(line)
        self.pid, self.segments = info["pid"], info["segments"]
        assert all(exists(n) for n in self.segments)

    def say(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        self.say()
        return self.proc.wait(60)

    def kill(self) -> None:
        """SIGKILL, and reap it: its pid then names no process (until the kernel reuses it)."""
        self.proc.kill()
        self.proc.wait(60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        for n in self.segments:  # whatever a failed test left
            if exists(n):
                os.unlink(os.path.join(SHM_DIR, n))
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


if __name__ == "__main__":
    main(sys.argv[1])
