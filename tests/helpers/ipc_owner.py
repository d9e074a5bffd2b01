"""A process that owns refit IPC segments, for the tests of who removes them and when.

Run as ``python ipc_owner.py MODE``. It opens an ``IpcTransport`` (its control segment) and
a staging segment holding bytes (what a host source stages for its receivers), prints one
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
import sys

_HELD: list = []  # alive until the interpreter ends: nothing but the exit hooks removes the segments


def main(mode: str) -> None:
    from refit.transport.ipc import SHM_DIR, IpcTransport, _Segment, _segment_name

    transport = IpcTransport(0)
    staging = _Segment(_segment_name("staging"), 1 << 16, create=True)
    staging.tensor().fill_(7)
    _HELD.extend([transport, staging])
    names = [transport._control.name, staging.name]
    print(json.dumps({"pid": os.getpid(), "segments": names}), flush=True)
    sys.stdin.readline()
    if mode == "raise":
        raise RuntimeError("an uncaught exception, the transport left open")
    if mode == "fork":
        child = os.fork()
        if child == 0:
            sys.exit(0)
        os.waitpid(child, 0)
        print(json.dumps({"after_fork": [os.path.exists(os.path.join(SHM_DIR, n)) for n in names]}), flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1])
