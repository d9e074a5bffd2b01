"""A late worker, a forged or replayed rendezvous value, and a stalled controller: one bounded failure at most.

Each case is driven for real: gloo groups over real TCP stores, forged values written by a
raw store client on the build's own port, a controller process stopped with SIGSTOP. Bounds
are what the sync was configured with plus slack for a busy machine, far below what the
failure cost without the rule under test.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import refit
from refit.comm.base import free_port
from refit.comm.group import StatelessProcessGroup
from refit.comm.rendezvous import RendezvousTampered, SealedStore, new_secret
from refit.control import RefitTampered, WorkersLate
from refit.errors import LateCall, RefitError
from refit.runtime.shards import call_deadline
from refit.testing.launch import scaled
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

HIDDEN = 32
SLACK_S = scaled(20.0)  # what a busy machine may add to a bound the test configured
CONNECT_S = 6.0  # the rebuild's rendezvous: long enough for a loaded machine, short against the lateness below


def test_a_store_client_gives_up_at_its_connect_deadline_not_the_group_timeout():
    """Nothing listens on the port (the build's host is gone): the client retried for the group's whole
    timeout (three times the bound here, so the bound tells the two apart on a machine of any load), and a
    worker joining a build that was over held every later call behind it."""
    port = free_port("127.0.0.1")
    bound = 2.0 + SLACK_S
    t0 = time.monotonic()
    with pytest.raises(RefitError, match="cannot reach the rendezvous store"):
        StatelessProcessGroup("127.0.0.1", port, 1, 2, timeout_s=3 * bound, init_timeout_s=2.0, secret=new_secret())
    assert time.monotonic() - t0 < bound


def test_a_call_is_counted_from_when_it_was_sent_and_abandoned_past_its_budget():
    now = time.time()
    left = call_deadline(now - 1.0, 5.0, "connect") - time.monotonic()
    assert 3.0 < left <= 4.0 + 1e-3
    with pytest.raises(LateCall, match="connect started 6.0s after the controller sent it, past its 5s budget"):
        call_deadline(now - 6.0, 5.0, "connect")
    assert call_deadline(None, 5.0, "connect") - time.monotonic() > 4.0  # unknown send time: the whole budget


class LateEngine(SyntheticEngine):
    """An engine worker that is late: it starts joining a build ``late_s`` late once, or it is busy in a long call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.late_s = 0.0

    def refit_connect(self, spec):
        late, self.late_s = self.late_s, 0.0
        if late:
            threading.Event().wait(late)  # the worker's own slowness, not the test waiting
        return super().refit_connect(spec)

    def busy(self, seconds: float) -> None:
        threading.Event().wait(seconds)


def _fleet(engine_cls=SyntheticEngine, shards=2, **kw):
    trainers = [SyntheticTrainer(0, 1, hidden=HIDDEN)]
    engines = [[engine_cls(s, 0, 1, hidden=HIDDEN)] for s in range(shards)]
    kw.setdefault("refit_timeout_s", 30.0)
    sync = refit.ReshardWeightSynchronizer(trainers, engines, connect_timeout_s=CONNECT_S, ping_timeout_s=5.0,
                                           grace_s=3.0, **kw)
    return sync, trainers, engines


def _step(trainers, step):
    for t in trainers:
        t.set_step(step)


@pytest.mark.timeout(240)
def test_a_worker_late_for_a_rebuild_costs_that_sync_only_and_is_named_late():
    sync, trainers, engines = _fleet(LateEngine)
    try:
        engines[1][0].late_s = CONNECT_S + 4.0  # it joins the first build's rendezvous after it is over
        _step(trainers, 1)
        t0 = time.monotonic()
        with pytest.raises(WorkersLate) as info:
            sync.sync_weights()
        elapsed = time.monotonic() - t0
        assert elapsed < sync.refit_timeout_s + sync.settle_budget_s() + SLACK_S
        err = info.value
        assert err.late == ["shard 1 worker 0"], err
        assert "answered late" in str(err) and "not dead or frozen" in str(err)
        assert "frozen or wedged" not in str(err)
        _step(trainers, 2)
        res = sync.sync_weights()  # the next sync rebuilds with it and verifies
        assert res.verified and res.shards == [0, 1]
        assert all(not e.check_weights(2) for s in engines for e in s)
    finally:
        sync.shutdown()


@pytest.mark.timeout(240)
def test_a_worker_busy_past_a_transfer_abandons_the_stale_call_and_the_next_sync_verifies():
    """The worker is busy in another call when the transfer reaches it: the transfer starts past its
    budget, is abandoned at once (``LateCall``, before a byte can land) instead of waiting out peers
    that are gone, and the next sync does not queue behind it."""
    sync, trainers, engines = _fleet(LateEngine, refit_timeout_s=6.0)
    sync.grace_s = 6.0  # the settle outlasts the worker's busy spell, so its answer is heard
    try:
        sync.init_communicator()
        busy = sync.engine_workers[1][0].call("busy", sync.refit_timeout_s + 2.0)
        _step(trainers, 1)
        with pytest.raises(WorkersLate) as info:
            sync.sync_weights()
        assert info.value.late == ["shard 1 worker 0"], info.value
        assert "LateCall" in info.value.failures["shard 1 worker 0"]
        busy.result(60)
        assert not any(t.any() for t in engines[1][0].params.values())  # nothing landed in it
        _step(trainers, 2)
        t0 = time.monotonic()
        res = sync.sync_weights()
        assert res.verified and res.rebuilt
        assert time.monotonic() - t0 < CONNECT_S + SLACK_S  # not held by a queue of stale calls
    finally:
        sync.shutdown()


class ForgedEngine(SyntheticEngine):
    """The victim of a stranger on the build's port: with torch's own client, a stranger tries to
    announce this rank and publish a forged gloo address for it before the rank itself can; the
    rank stays away meanwhile."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.forge = False
        self.forged = threading.Event()

    def refit_connect(self, spec):
        if self.forge:
            self.forge = False
            threading.Thread(target=self._stranger, args=(spec.address, spec.port, spec.epoch, spec.rank),
                             daemon=True).start()
            self.forged.wait(60)
            threading.Event().wait(spec.timeout_s)  # it stays away: the others read the stranger's value
        return super().refit_connect(spec)

    def _stranger(self, address, port, epoch, rank):
        try:
            store = dist.TCPStore(address, port, None, False, timeout=timedelta(seconds=5))
            store.set(f"refit/{epoch}/arrived/{rank}", b"1")
            store.set(f"refit/{epoch}/gloo/0/{rank}", os.urandom(170))
        except Exception:  # the store does not let it in: what the test expects
            pass
        finally:
            self.forged.set()


@pytest.mark.timeout(240)
def test_a_stranger_in_a_rebuild_is_the_headline_error_and_the_next_sync_verifies():
    sync, trainers, engines = _fleet(ForgedEngine)
    try:
        sync.init_communicator()
        victim = engines[1][0]
        victim.forge = True
        sync.replace_shard(1, [victim])  # the next sync rebuilds, and the stranger strikes in its rendezvous
        _step(trainers, 1)
        t0 = time.monotonic()
        with pytest.raises(RefitTampered) as info:
            sync.sync_weights()
        assert time.monotonic() - t0 < sync.refit_timeout_s + sync.settle_budget_s() + SLACK_S
        err = info.value
        assert isinstance(err, RendezvousTampered)
        assert err.seen_by == "trainer rank 0" and err.rank == 0  # the store's host saw it
        assert "did not prove it holds the build's secret" in str(err) and "frozen" not in str(err)
        # the stranger's worker may still be inside the tampered build's rendezvous, which it leaves at
        # its connect deadline: a call queued behind it tells when it is free. Sent earlier, the next
        # sync's connect would start past its own deadline there, and be abandoned as late.
        sync.engine_workers[1][0].call("refit_ping").result(scaled(60.0))
        _step(trainers, 2)
        res = sync.sync_weights()  # a fresh secret, nonce and port
        assert res.verified and res.rebuilt
        assert all(not e.check_weights(2) for s in engines for e in s)
    finally:
        sync.shutdown()


def test_a_value_replayed_from_another_build_under_the_same_secret_is_refused():
    """Two builds share a secret (a user's ``REFIT_RENDEZVOUS_SECRET``): a value one build wrote, recorded
    off the wire and written into the other build's store under the same key, does not verify there."""
    secret = new_secret()
    ports = [free_port("127.0.0.1") for _ in range(2)]
    hosts = [dist.TCPStore("127.0.0.1", p, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
             for p in ports]
    first = SealedStore(hosts[0], secret, b"refit/1\0" + b"nonce-of-build-1")
    second = SealedStore(hosts[1], secret, b"refit/1\0" + b"nonce-of-build-2")
    first.set("refit/1/ago/1/0", b"roster of rank 0")
    hosts[1].set("refit/1/ago/1/0", hosts[0].get("refit/1/ago/1/0"))  # the replay, byte for byte
    with pytest.raises(RendezvousTampered, match="'refit/1/ago/1/0'") as info:
        second.get("refit/1/ago/1/0")
    assert info.value.key == "refit/1/ago/1/0" and second.tampered == "refit/1/ago/1/0"
    assert SealedStore(hosts[0], secret, b"refit/1\0" + b"nonce-of-build-1").get("refit/1/ago/1/0") == \
        b"roster of rank 0"


def test_groups_on_one_secret_bind_their_values_to_their_own_build(monkeypatch):
    """Without a nonce, a group binds its name, address, port and size: the same secret from the
    environment for two builds of the same name still gives two sets of values."""
    monkeypatch.setenv("REFIT_RENDEZVOUS_SECRET", new_secret().hex())
    groups = {}
    for build in range(2):
        port = free_port("127.0.0.1")
        made = {}

        def join(rank, port=port, made=made):
            made[rank] = StatelessProcessGroup("127.0.0.1", port, rank, 2, timeout_s=30.0, name="refit/1")

        threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        groups[build] = made
    try:
        groups[0][0].store.set("probe", b"build 0")
        raw = groups[0][0].store.inner.get("probe")
        groups[1][0].store.inner.set("probe", raw)
        with pytest.raises(RendezvousTampered, match="'probe'"):
            groups[1][1].store.get("probe")
        assert groups[0][1].store.get("probe") == b"build 0"
    finally:
        for made in groups.values():
            for g in made.values():
                g.abort()


_STOPPED_CONTROLLER = r"""
import sys, refit
from refit.runtime.handles import ProcessWorker
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer
from refit.testing.launch import scaled
trainers = [ProcessWorker(SyntheticTrainer, 0, 1, hidden=32, name="trainer 0", start_timeout_s=scaled(120))]
engines = [[ProcessWorker(SyntheticEngine, s, 0, 1, hidden=32, transfer_delay_s=float(sys.argv[1]),
                          name=f"shard {s} worker 0", start_timeout_s=scaled(120))] for s in range(2)]
sync = refit.ReshardWeightSynchronizer(trainers, engines, refit_timeout_s=4.0, grace_s=1.0, ping_timeout_s=3.0,
                                       connect_timeout_s=60.0)
sync.init_communicator()
for step in (1, 2):
    for t in trainers:
        t.call("set_step", step).result(60)
    print(f"sync {step}", flush=True)
    res = sync.sync_weights()
    bad = [e.call("check_weights", step).result(60) for s in engines for e in s]
    stalls = [ev.detail for ev in res.events if "stalled" in ev.detail]
    print(f"step {step} verified={res.verified} wrong={sum(bool(b) for b in bad)} stalls={stalls}", flush=True)
sync.shutdown()
"""


@pytest.mark.timeout(400)
def test_a_controller_stopped_mid_transfer_keeps_the_answers_that_arrived():
    """SIGSTOP the controller process while its workers transfer, for longer than the refit deadline:
    the workers finish meanwhile, and their answers count (the round succeeds, noting the stall),
    instead of an error with an empty name followed by "every worker answers"."""
    delay_s = 1.5  # each transfer holds this long, so that the stop lands inside one
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_CONTROLLER, str(delay_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("sync 2"):
                threading.Event().wait(0.3 * delay_s)  # into the transfer, which lasts delay_s
                os.kill(proc.pid, signal.SIGSTOP)
                threading.Event().wait(8.0)  # the stop: twice the refit deadline
                os.kill(proc.pid, signal.SIGCONT)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert proc.returncode == 0, text
    assert "step 1 verified=True wrong=0" in text and "step 2 verified=True wrong=0" in text, text
    step2 = next(line for line in lines if line.startswith("step 2"))
    assert "controller stalled" in step2, text


_FLOOD = r"""
import os, socket, sys
port, values = int(sys.argv[1]), int(sys.argv[2])
chunk = os.urandom(8 << 20)
sent = 0
for _ in range(values):  # each on a connection of its own, as a client that reconnects would
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(chunk)
            sent += 1
    except OSError:
        pass
print("sent", sent, flush=True)
"""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.timeout(240)
def test_a_strangers_flood_is_refused_at_the_door_and_fails_the_build_as_tampered():
    """Forty-eight 8 MiB values from a stranger while the build waits for its last rank: the store
    host (this process) reads at most a proof's worth of each, and the build fails as tampered."""
    port, out = free_port("127.0.0.1"), {}
    secret = new_secret()
    before = _rss_bytes()

    def host():
        try:
            out[0] = StatelessProcessGroup("127.0.0.1", port, 0, 2, timeout_s=60.0, init_timeout_s=60.0,
                                           secret=secret)
        except BaseException as e:  # reported to the test
            out[0] = e

    t = threading.Thread(target=host, daemon=True)
    t0 = time.monotonic()
    t.start()
    flood = subprocess.run([sys.executable, "-c", _FLOOD, str(port), "48"], capture_output=True, text=True,
                           timeout=180)
    t.join(120)
    assert not t.is_alive()
    err = out[0]
    assert isinstance(err, RendezvousTampered), err
    assert "did not prove it holds the build's secret" in str(err)
    assert time.monotonic() - t0 < 60.0  # within the build's deadline, not at it
    assert _rss_bytes() - before < 64 << 20, (before, _rss_bytes(), flood.stdout, flood.stderr)
