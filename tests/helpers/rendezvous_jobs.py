"""Ranks of a two-rank group that a stranger on the store's port tries to subvert.

Each rank joins, says so, and waits for the test's go before it exchanges a value,
so the stranger's writes land first and deterministically.
"""

from __future__ import annotations

import os


def exchange_after_go(conn, rank: int, port: int, secret: bytes | None) -> None:
    from refit.comm.group import StatelessProcessGroup

    try:
        group = StatelessProcessGroup("127.0.0.1", port, rank, 2, timeout_s=30, secret=secret)
    except BaseException as e:  # reported to the test
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("joined", os.getpid()))
    while conn.recv() == "go":  # anything else: leave
        try:
            conn.send(("gathered", group.all_gather_object({"rank": rank})))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
    group.abort()
