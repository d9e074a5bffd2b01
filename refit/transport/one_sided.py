"""What the one-sided transports share: a roster the controller relays, epochs, deadlines, abort.

NIXL and the one-node IPC transport move a plan without a collective. Each rank tells
its peers, once per plan, where they write to it or read from it (a roster entry); the
controller relays every entry to every rank under a new membership epoch. The checks of
an installed roster, the one-time handshake through a process group, and the watchdog's
interface (``set_deadline``, ``abort``) are the same for both, and live here, as does
the shape of one refit: the checks before it starts, and a loop that polls the peers
without blocking on any one of them, so a dead or silent peer is named at the deadline,
on an abort, or when a liveness probe finds it gone, while the other peers' work goes on.

Each is two objects. A *channel* (``OneSidedChannel``) is what outlives a plan: the agent
or control segment, the memory registered or exported, the peers loaded or mapped, the
membership epoch, the deadline and the abort. An *executor* is one plan on it, behind the
one contract every transport has (``refit.transport.base.Executor``): it binds its tensors
to the channel (``bind``), and its refits run rounds of the channel
(``begin_round``, ``poll_round``). A channel serves the executor bound last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from refit.comm.wire import register_record
from refit.errors import RefitAborted, RefitError, TransportError
from refit.transport.base import TransferStats
from refit.transport.buckets import ChecksumLedger


@dataclass(frozen=True)
class RosterEntries:
    """One rank's entries when it runs two one-sided transports: IPC inside its node, NIXL across."""

    rank: int
    ipc: Any
    nixl: Any


register_record(RosterEntries)


@dataclass
class OneSidedRound:
    """One refit's bookkeeping: its sequence number, deadline, stats, ledger and failed peers."""

    seq: int
    started: float  # time.monotonic()
    deadline: float | None
    stats: TransferStats
    ledger: ChecksumLedger | None
    t0: float = field(default_factory=time.perf_counter)
    failed: dict[int, str] = field(default_factory=dict)  # peer -> why; its work is dropped, the others' goes on


class OneSidedChannel:
    """Base of ``NixlChannel`` and ``IpcChannel``; see the module docstring.

    Subclasses set ``transport`` and ``handshake_error``, keep ``rank``, ``epoch``,
    ``bound`` (the executor whose plan the channel serves) and ``_local_digest`` current, and
    implement ``local_roster_entry`` and ``update_membership`` (which starts with ``_check_roster``).
    """

    transport: ClassVar[str] = ""
    handshake_error: ClassVar[type[TransportError]] = TransportError
    label: ClassVar[str] = ""  # the transport's name in messages
    reregistered: ClassVar[str] = ""  # what this rank did that makes its installed roster entry stale
    max_nap_s: ClassVar[float] = 1e-3  # the longest a waiting rank sleeps between polls
    probe_interval_s: float

    def __init__(self, rank: int):
        self.rank = int(rank)
        self.epoch = -1
        self.bound: Any = None  # the executor this channel serves
        self.seq = 0  # refits run under the installed membership
        self.runs = 0  # refits run in all
        self.timeout_s: float | None = None
        self._local_digest = ""
        self._installed_digest: str | None = None
        self._aborted = threading.Event()
        self._deadline: float | None = None
        self._closed = False

    @property
    def identity(self) -> str:
        """This rank's name in the rosters: unique per rank and per incarnation."""
        raise NotImplementedError

    @staticmethod
    def entry_identity(entry: Any) -> str:
        raise NotImplementedError

    def local_roster_entry(self) -> Any:
        raise NotImplementedError

    def update_membership(self, roster: Mapping[int, Any], epoch: int) -> None:
        raise NotImplementedError

    def _check_roster(self, roster: Mapping[int, Any], epoch: int, peers: Sequence[int]) -> int:
        """The checks every installed roster passes first; returns ``epoch`` as an int.

        The epoch must be new, the roster must carry this rank's entry as it is now (a
        stale one would send peers to memory this rank no longer uses), and every peer
        of this rank's plan must be in it.
        """
        self._check_open()
        if self.bound is None:
            raise RefitError(f"rank {self.rank}: bind an executor (executor.prepare(src, dst)) before "
                             "update_membership()")
        epoch = int(epoch)
        error = self.handshake_error
        if epoch <= self.epoch:
            raise error(f"rank {self.rank}: a new roster needs a new epoch: got {epoch}, the installed one is "
                        f"{self.epoch}")
        me = roster.get(self.rank)
        if me is None or self.entry_identity(me) != self.identity or me.digest != self._local_digest:
            have = "none" if me is None else f"{self.entry_identity(me)} digest {me.digest}"
            raise error(f"rank {self.rank}: the roster of epoch {epoch} carries a stale entry for this rank ({have}; "
                        f"this rank is {self.identity} digest {self._local_digest}): relay the local_roster_entry() "
                        "taken after the last bind")
        missing = [p for p in peers if p not in roster]
        if missing:
            raise error(f"rank {self.rank}: the roster of epoch {epoch} lacks rank(s) {missing}, which this rank's "
                        "plan exchanges with; rebuild the plan for this membership")
        return epoch

    def handshake(self, exchange: Any, *, epoch: int | None = None) -> dict[int, Any]:
        """The one-time handshake: gather every rank's entry through ``exchange`` and install it.

        ``exchange`` is anything with ``all_gather_object`` (a ``StatelessProcessGroup``, a
        torch group wrapper) or a callable ``entry -> list of entries``; it is used once
        here, never by ``run``. Every rank of the exchange calls this (a rank with nothing
        to move binds an executor of its empty plan first). Returns the roster.
        """
        entry = self.local_roster_entry()
        gather = getattr(exchange, "all_gather_object", None)
        gathered = gather(entry) if gather is not None else exchange(entry)
        roster = {e.rank: e for e in gathered if e is not None}
        self.update_membership(roster, self.epoch + 1 if epoch is None else epoch)
        return roster

    # -- one refit --------------------------------------------------------------------------------
    def begin_round(self, *, verify: bool, check: Callable[[], None] = lambda: None) -> OneSidedRound:
        """The checks every refit passes before any byte moves (then ``check``, the transport's
        own), then its number and deadline. A refit refused here takes no sequence number, so
        its peers still agree on the next one."""
        self._check_open()
        error = self.handshake_error
        if self.bound is None:
            raise RefitError(f"rank {self.rank}: bind an executor (executor.prepare(src, dst)) before a refit")
        if self._installed_digest is None or self.epoch < 0:
            raise error(f"rank {self.rank}: no handshake yet: relay local_roster_entry() through "
                        "update_membership() (or call handshake()) before run()")
        if self._installed_digest != self._local_digest:
            raise error(f"rank {self.rank}: {self.reregistered} since the roster of epoch {self.epoch} was "
                        "installed; relay the new local_roster_entry() with update_membership() before run()")
        if self._aborted.is_set():
            raise RefitAborted(f"rank {self.rank}: this {self.label} transport was aborted; install a new "
                               "membership (update_membership) before the next refit")
        check()
        seq = self.seq
        self.seq += 1
        self.runs += 1
        started = time.monotonic()
        deadline = None if self.timeout_s is None else started + self.timeout_s
        if self._deadline is not None:
            deadline = self._deadline if deadline is None else min(deadline, self._deadline)
        return OneSidedRound(seq, started, deadline, TransferStats(), ChecksumLedger() if verify else None)

    def poll_round(self, rnd: OneSidedRound, *, pending: Callable[[], bool], step: Callable[[], int],
                    missing: Callable[[], str], probe: Callable[[], None],
                    nap: Callable[[int], None] | None = None) -> None:
        """Run ``step`` (returns how much it moved) until nothing is ``pending``.

        While nothing moves, the round ends in ``RefitAborted`` naming what is ``missing``
        on an abort or at its deadline; every ``probe_interval_s`` the silent peers are
        probed (``probe`` marks the dead ones failed, which drops their work); in between
        the rank naps, a little longer each idle poll, up to ``max_nap_s``.
        """
        last_probe = time.monotonic()
        idle = 0
        while pending():
            if step():
                idle = 0
                continue
            now = time.monotonic()
            if self._aborted.is_set():
                raise RefitAborted(self.where(rnd.seq) + ": aborted; " + missing())
            if rnd.deadline is not None and now >= rnd.deadline:
                raise RefitAborted(self.where(rnd.seq) + f": its deadline passed ({rnd.deadline - rnd.started:.3g}s "
                                   "in); " + missing())
            if now - last_probe >= self.probe_interval_s:
                last_probe = now
                probe()
            idle += 1
            (nap or self.nap)(idle)

    def nap(self, idle: int) -> None:
        """Sleep between two idle polls: a little longer each time, up to ``max_nap_s``."""
        time.sleep(min(self.max_nap_s, 2e-6 * (1 << min(idle, 10))))

    def raise_failed(self, rnd: OneSidedRound) -> None:
        """A round in which peers failed ends here, naming each, once the others' work is done."""
        if rnd.failed:
            raise RefitAborted(self.where(rnd.seq) + ": " + self.failures(rnd.failed)
                               + ". The other peers' transfers completed.")

    def failures(self, failed: Mapping[int, str]) -> str:
        return "; ".join(f"rank {p} ({self.peer_name(p)}) failed: {why}" for p, why in sorted(failed.items()))

    def peer_name(self, peer: int) -> str:
        raise NotImplementedError

    def where(self, seq: int) -> str:
        return f"{self.label} refit (epoch {self.epoch}, seq {seq}) on rank {self.rank}"

    # -- deadline and abort (the watchdog's interface) ----------------------------------------
    def set_deadline(self, deadline: float | None) -> None:
        """``time.monotonic()`` by which ``run`` must end (``RefitAbortWatchdog`` sets it)."""
        self._deadline = deadline

    def abort(self) -> None:
        """Make a ``run`` in progress raise ``RefitAborted`` now (idempotent; thread-safe).

        The transport stays unusable until ``update_membership`` installs a new roster.
        """
        self._aborted.set()

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def close(self) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise RefitError(f"{type(self).__name__} of rank {self.rank} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["OneSidedChannel", "OneSidedRound", "RosterEntries"]
