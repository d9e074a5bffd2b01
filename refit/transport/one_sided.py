"""What the one-sided transports share: a roster the controller relays, epochs, deadlines, abort.

NIXL and the one-node IPC transport move a plan without a collective. Each rank tells
its peers, once per plan, where they write to it or read from it (a roster entry); the
controller relays every entry to every rank under a new membership epoch. The checks of
an installed roster, the one-time handshake through a process group, and the watchdog's
interface (``set_deadline``, ``abort``) are the same for both, and live here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from refit.comm.wire import register_record
from refit.errors import RefitError, TransportError


@dataclass(frozen=True)
class RosterEntries:
    """One rank's entries when it runs two one-sided transports: IPC inside its node, NIXL across."""

    rank: int
    ipc: Any
    nixl: Any


register_record(RosterEntries)


class OneSidedTransport:
    """Base of ``NixlTransport`` and ``IpcTransport``; see the module docstring.

    Subclasses set ``transport`` and ``handshake_error``, keep ``rank``, ``epoch``,
    ``plan`` and ``_local_digest`` current, and implement ``local_roster_entry`` and
    ``update_membership`` (which starts with ``_check_roster``).
    """

    transport: ClassVar[str] = ""
    handshake_error: ClassVar[type[TransportError]] = TransportError

    def __init__(self, rank: int):
        self.rank = int(rank)
        self.epoch = -1
        self.plan = None
        self._local_digest = ""
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
        if self.plan is None:
            raise RefitError(f"rank {self.rank}: prepare(plan, src, dst) before update_membership()")
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
                        "taken after the last prepare()")
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
        to move passes its empty plan). Returns the roster.
        """
        entry = self.local_roster_entry()
        gather = getattr(exchange, "all_gather_object", None)
        gathered = gather(entry) if gather is not None else exchange(entry)
        roster = {e.rank: e for e in gathered if e is not None}
        self.update_membership(roster, self.epoch + 1 if epoch is None else epoch)
        return roster

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


__all__ = ["OneSidedTransport", "RosterEntries"]
