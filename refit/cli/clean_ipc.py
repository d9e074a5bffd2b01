"""``refit clean-ipc``: remove the shared-memory segments of refit processes that are gone.

An IPC rank on the host keeps its control words and, as a source, the weights it staged for
its receivers in files under ``/dev/shm``, in plain form. It removes them when its transport
closes and when it exits, but a process killed outright (SIGKILL, the OOM killer, SIGTERM's
default action) cannot, and the files outlive it. Any IPC transport that starts on the host,
and every plan a controller builds there, removes them; where no refit process runs anymore,
nothing would, and this command does.

Only refit's segments are touched (``refit-ipc-<pid namespace>-<pid>-<start time>-...``), and
only those whose owner no longer runs: no process has its pid, or the process that has it
started at another time than the owner (the kernel reused the pid). Segments of another pid
namespace (another container sharing this ``/dev/shm``) are kept, since their owners cannot
be seen from here. ``--dry-run`` lists what would be removed and removes nothing.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="list the stale segments; remove nothing")
    p.add_argument("--verbose", action="store_true", help="also list the segments kept, and why")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run(args) -> int:
    from refit.transport.ipc import SHM_DIR, list_segments, sweep_stale_segments

    kept = [s for s in list_segments() if not s.stale]
    removed, failed = sweep_stale_segments(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for seg in removed:
        print(f"{verb} {seg.describe()}")
    for seg, why in failed:
        print(f"could not remove {seg.describe()}: {why}")
    if args.verbose:
        for seg in kept:
            print(f"kept {seg.describe()}")
    total = sum(s.nbytes for s in removed)
    print(f"{verb} {len(removed)} segment(s) of processes that are gone ({_mb(total)}) under {SHM_DIR}; "
          f"kept {len(kept)} of running processes or other pid namespaces"
          + (f"; {len(failed)} could not be removed" if failed else ""))
    return 1 if failed else 0
