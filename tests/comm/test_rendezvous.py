"""A stranger on the rendezvous port can neither inject a value nor make a rank run anything.

The store listens on the master address's interface only, every value is sealed with the
build's secret, and what a rank reads is decoded as data, never unpickled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import threading
from datetime import timedelta
from multiprocessing.connection import wait as wait_conns

import numpy as np
import pytest
import torch.distributed as dist
from helpers import rendezvous_jobs

from refit import Replicate, Shard
from refit.comm import wire
from refit.comm.group import StatelessProcessGroup, free_port
from refit.comm.rendezvous import RendezvousTampered, SealedStore, new_secret, resolve_secret
from refit.layout import StridedShard
from refit.plan import RosterEntry
from refit.runtime.handles import listening_sockets


class _Payload:
    """Unpickling this creates ``path``: proof that a rank ran a stranger's code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _recv(conn, timeout_s: float = 60.0):
    if not wait_conns([conn], timeout_s):
        raise TimeoutError("a rank did not answer")
    return conn.recv()


class _Ranks:
    def __init__(self, secret: bytes | None):
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rendezvous_jobs.exchange_after_go, args=(child, rank, self.port, secret),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self.pids = []
        for c in self.conns:
            kind, value = _recv(c)
            assert kind == "joined", value
            self.pids.append(value)

    def go(self, ranks=(0, 1)) -> dict[int, tuple]:
        for r in ranks:
            self.conns[r].send("go")
        return {r: _recv(self.conns[r]) for r in ranks}

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send("leave")
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _stranger(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10), wait_for_workers=False)


def _rank_in_thread(rank: int, port: int, secret: bytes | None, out: dict) -> threading.Thread:
    """A rank in a thread of this process: a stranger's code that ran would run here, where the test looks."""

    def run():
        try:
            out[rank] = StatelessProcessGroup("127.0.0.1", port, rank, 2, timeout_s=5, secret=secret)
        except BaseException as e:  # reported to the test
            out[rank] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _two_ranks(secret: bytes | None):
    port, out = free_port(), {}
    for t in [_rank_in_thread(r, port, secret, out) for r in (0, 1)]:
        t.join(60)
    assert all(isinstance(out.get(r), StatelessProcessGroup) for r in (0, 1)), out
    return port, out[0], out[1]


def test_a_stranger_cannot_make_a_rank_run_code_without_a_secret():
    """Without a secret the store is torch's and open: a stranger's value is still data only."""
    port, rank0, rank1 = _two_ranks(None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            marker = os.path.join(tmp, "ran")
            stranger = _stranger(port)
            # rank 1's next value, published before rank 1 writes it: rank 0 reads it first
            stranger.set("refit/ago/1/1", pickle.dumps(_Payload(marker)))
            with pytest.raises(wire.WireFormatError, match="not a value"):
                rank0.all_gather_object({"rank": 0})
            assert not os.path.exists(marker), "a rank unpickled a stranger's value"
    finally:
        rank0.abort()
        rank1.abort()


def test_with_a_secret_a_stranger_cannot_reach_the_store_once_every_rank_is_in():
    """Every rank proved the secret, so the store accepts no one else: a stranger's client is refused
    at connect, and the ranks go on exchanging values."""
    port, rank0, rank1 = _two_ranks(new_secret())
    try:
        with pytest.raises((RuntimeError, OSError)):
            dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=2), wait_for_workers=False)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(1, rank1.all_gather_object({"rank": 1})))
        t.start()
        assert rank0.all_gather_object({"rank": 0}) == [{"rank": 0}, {"rank": 1}]
        t.join(30)
        assert out[1] == [{"rank": 0}, {"rank": 1}]
    finally:
        rank0.abort()
        rank1.abort()


def test_sealed_ranks_exchange_and_listen_on_loopback_only():
    ranks = _Ranks(new_secret())
    try:
        got = ranks.go()
        assert all(g == ("gathered", [{"rank": 0}, {"rank": 1}]) for g in got.values()), got
        listening = {pid: listening_sockets(pid) for pid in ranks.pids}
        # every rank proved the secret, so the store's port closed: only gloo's pairs listen
        assert ranks.port not in {port for addrs in listening.values() for _, port in addrs}
        for pid, addrs in listening.items():
            assert addrs, f"rank process {pid} listens on nothing (gloo pairs expected)"
            wide = [a for a in addrs if a[0] not in ("127.0.0.1", "::1")]
            assert not wide, f"rank process {pid} listens beyond loopback: {wide}"
    finally:
        ranks.close()


def test_sealed_store_refuses_values_moved_between_keys():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = SealedStore(host, new_secret())
    store.set("a", b"value of a")
    assert store.get("a") == b"value of a"
    host.set("b", host.get("a"))  # a sealed value replayed under another key
    with pytest.raises(RendezvousTampered, match="'b'"):
        store.get("b")
    other = SealedStore(host, new_secret())  # an earlier build's secret does not open this one's values
    with pytest.raises(RendezvousTampered):
        other.get("a")


def test_secrets_are_checked():
    assert resolve_secret(None) is None or os.environ.get("REFIT_RENDEZVOUS_SECRET")
    s = new_secret()
    assert resolve_secret(s.hex()) == s
    with pytest.raises(Exception, match="hex"):
        resolve_secret("not hex")
    with pytest.raises(Exception, match="at least 16 bytes"):
        resolve_secret(b"short")


def test_wire_carries_data_and_registered_records_only():
    entry = RosterEntry.make("w", (4, 8), "float32", np.arange(4).reshape(2, 2), [Shard(0), Replicate()], "src")
    value = {"entries": [entry], "nested": ((1, 2.5), [None, True, b"\x00\xff"]), 7: {(0, 3): (1, 2, 3)},
             "placement": StridedShard(0, 2), "big": 2**62}
    back = wire.unpack(wire.pack(value))
    assert back["nested"] == ((1, 2.5), [None, True, b"\x00\xff"]) and back[7] == {(0, 3): (1, 2, 3)}
    assert back["placement"] == StridedShard(0, 2) and back["big"] == 2**62
    got = back["entries"][0]
    assert (got.name, got.global_shape, got.placements, got.role) == ("w", (4, 8), [Shard(0), Replicate()], "src")
    np.testing.assert_array_equal(got.mesh, np.arange(4).reshape(2, 2))
    with pytest.raises(wire.WireFormatError, match="_Payload cannot be sent"):
        wire.pack({"x": _Payload("/nonexistent")})
    with pytest.raises(wire.WireFormatError):
        wire.unpack(pickle.dumps({"x": 1}))
    with pytest.raises(wire.WireFormatError, match="not registered"):
        wire.unpack(wire.pack(Shard(0)).replace(b"refit.layout.Shard", b"builtins.eval.....x"[:18]))
