"""A small ctypes binding to NCCL, and the communicator ``StatelessProcessGroup`` builds on it.

Why a binding of our own rather than torch's ``ProcessGroupNCCL`` or ``nccl4py`` is written
down in ``docs/comm.md``. In short: refit has to own the unique id (the two peer protocols
publish it under keys of their own, in their own formats, so that a vLLM or NeMo rank can
join the same communicator), group sends and receives to one peer in one NCCL group
(an ungrouped receive-then-send between two ranks deadlocks), initialise without
blocking so that a peer that never comes raises instead of hanging, and abort from
another thread. All of that is NCCL's public C API; the binding is a few dozen entry
points over the ``libnccl.so.2`` that torch has already loaded into the process.

Every communicator is created non-blocking (``ncclConfig_t.blocking = 0``), so no NCCL
call can hold the calling thread: calls return ``ncclInProgress`` and the caller polls
``ncclCommGetAsyncError`` until the deadline, checking its abort flag on every turn. A
lock serialises the calls on one communicator, and ``abort()`` takes it, so a thread
that is polling can never touch a communicator that another thread has just freed.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

from refit.comm.base import NcclAborted, NcclTimeout, poll_until
from refit.errors import TransportError

NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
NCCL_SPLIT_NOCOLOR = -1
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT
_API_MAGIC = 0xCAFEBEEF
# The config layout below is NCCL 2.18's (through ``splitShare``). NCCL reads ``size``
# bytes of it and fills every newer field with its default, so one layout serves every
# library from 2.18 on.
_CONFIG_VERSION = 21800

# ncclDataType_t / ncclRedOp_t
UINT8 = 1
FLOAT32 = 7
SUM = 0

_RESULTS = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}


class NcclError(TransportError):
    """An NCCL call failed (the message carries NCCL's own error string)."""


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class Config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def make_config(*, blocking: bool = False, split_share: bool | None = None) -> Config:
    c = Config()
    c.size = ctypes.sizeof(Config)
    c.magic = _API_MAGIC
    c.version = _CONFIG_VERSION
    c.blocking = 1 if blocking else 0
    c.cgaClusterSize = c.minCTAs = c.maxCTAs = _UNDEF_INT
    c.netName = None
    c.splitShare = _UNDEF_INT if split_share is None else int(bool(split_share))
    return c


def _loaded_nccl_paths() -> list[str]:
    """libnccl files already mapped into this process (torch's CUDA build links one)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl" in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.exists(p))


def find_library() -> str:
    """Where libnccl is: ``$REFIT_NCCL_LIBRARY``, else the copy torch loaded, else a wheel's."""
    env = os.environ.get("REFIT_NCCL_LIBRARY")
    if env:
        return env
    try:
        import torch  # noqa: F401  - loads libtorch_cuda, and with it libnccl
        if torch.cuda.is_available():
            torch.cuda.init()
    except Exception:
        pass
    loaded = _loaded_nccl_paths()
    if loaded:
        return loaded[0]
    for base in sys.path:
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "nvidia/*/lib/libnccl.so*"):
            hits = sorted(glob.glob(os.path.join(base, pattern)))
            if hits:
                return hits[0]
    return "libnccl.so.2"


class NcclLibrary:
    """The NCCL entry points refit uses, with argument types declared once."""

    def __init__(self, path: str | None = None):
        self.path = path or find_library()
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise NcclError(
                f"cannot load NCCL from {self.path!r} ({e}); a CUDA build of torch ships it, "
                "or point REFIT_NCCL_LIBRARY at libnccl.so.2"
            ) from e
        L = self._lib
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        P = ctypes.POINTER
        sig = {
            "ncclGetVersion": [P(c_int)],
            "ncclGetUniqueId": [P(UniqueId)],
            "ncclCommInitRankConfig": [P(c_void_p), c_int, UniqueId, c_int, P(Config)],
            "ncclCommGetAsyncError": [c_void_p, P(c_int)],
            "ncclCommAbort": [c_void_p],
            "ncclCommSplit": [c_void_p, c_int, c_int, P(c_void_p), P(Config)],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
            "ncclSend": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclRecv": [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclBroadcast": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
            "ncclAllReduce": [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p],
        }
        for name, args in sig.items():
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = c_int
        L.ncclGetErrorString.argtypes = [c_int]
        L.ncclGetErrorString.restype = ctypes.c_char_p
        self._last_error = getattr(L, "ncclGetLastError", None)
        if self._last_error is not None:
            self._last_error.argtypes = [c_void_p]
            self._last_error.restype = ctypes.c_char_p
        v = c_int()
        self.check(L.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        self.version_code = v.value
        self.version = (v.value // 10000, v.value // 100 % 100, v.value % 100)

    def describe(self, rc: int, comm: int | None = None) -> str:
        text = self._lib.ncclGetErrorString(rc)
        msg = f"{_RESULTS.get(rc, rc)}: {text.decode() if text else ''}"
        if self._last_error is not None:
            last = self._last_error(comm)
            if last:
                msg += f" ({last.decode(errors='replace')})"
        return msg

    def check(self, rc: int, what: str, comm: int | None = None) -> int:
        if rc not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
            raise NcclError(f"{what} failed: {self.describe(rc, comm)}")
        return rc

    @property
    def lib(self):
        return self._lib

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)


_LIB: NcclLibrary | None = None
_LIB_LOCK = threading.Lock()


def library() -> NcclLibrary:
    global _LIB
    with _LIB_LOCK:
        if _LIB is None:
            _LIB = NcclLibrary()
        return _LIB


def _uid_from_bytes(raw: bytes) -> UniqueId:
    if len(raw) != 128:
        raise NcclError(f"an NCCL unique id is 128 bytes, got {len(raw)}")
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), raw, 128)
    return uid


class NcclComm:
    """One non-blocking NCCL communicator: thread-safe calls, polling with a deadline, abort."""

    def __init__(self, handle: int, rank: int, world_size: int, device: int, lib: NcclLibrary,
                 aborted: threading.Event):
        self.handle = handle
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.lib = lib
        self._aborted = aborted  # shared with the owning group: its abort wakes our pollers
        self._lock = threading.RLock()
        self.connected: set[int] = set()  # peers whose p2p connections are open (see connect_peers)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def init_rank(cls, unique_id: bytes, rank: int, world_size: int, device: int, *,
                  deadline: float | None, aborted: threading.Event, lib: NcclLibrary | None = None
                  ) -> NcclComm:
        """``ncclCommInitRankConfig`` without blocking; raises ``NcclTimeout`` at the deadline."""
        import torch

        lib = lib or library()
        handle = ctypes.c_void_p()
        cfg = make_config(blocking=False)
        with torch.cuda.device(device):
            rc = lib.lib.ncclCommInitRankConfig(ctypes.byref(handle), world_size, _uid_from_bytes(unique_id),
                                                rank, ctypes.byref(cfg))
        lib.check(rc, "ncclCommInitRankConfig")
        if not handle.value:
            raise NcclError("ncclCommInitRankConfig returned no communicator")
        comm = cls(handle.value, rank, world_size, device, lib, aborted)
        try:
            comm.settle("NCCL init", deadline=deadline)
        except BaseException:
            comm.abort_in_background()
            raise
        return comm

    def split(self, color: int | None, key: int, *, deadline: float | None, aborted: threading.Event,
              share: bool = True) -> NcclComm | None:
        """``ncclCommSplit``: every rank of this communicator calls it; ``color=None`` opts out.

        ``share=True`` sets ``splitShare``: the child shares the parent's resources (and its
        abort flag), so it costs no new connections.
        """
        handle = ctypes.c_void_p()
        cfg = make_config(blocking=False, split_share=share)
        c = NCCL_SPLIT_NOCOLOR if color is None else int(color)
        with self._lock:
            self._live("ncclCommSplit")
            import torch

            with torch.cuda.device(self.device):
                rc = self.lib.lib.ncclCommSplit(self.handle, c, int(key), ctypes.byref(handle), ctypes.byref(cfg))
            self.lib.check(rc, "ncclCommSplit", self.handle)
        self.settle("ncclCommSplit (parent)", deadline=deadline)
        if color is None or not handle.value:
            return None
        child = NcclComm(handle.value, -1, -1, self.device, self.lib, aborted)
        try:
            child.settle("ncclCommSplit (child)", deadline=deadline)
        except BaseException:
            child.abort_in_background()
            raise
        return child

    # -- state -----------------------------------------------------------------------------
    @property
    def aborted(self) -> bool:
        return self._aborted.is_set() or self.handle is None

    def _live(self, what: str) -> None:
        if self._aborted.is_set() or self.handle is None:
            raise NcclAborted(f"{what}: the NCCL communicator was aborted")

    def async_error(self) -> int:
        with self._lock:
            self._live("ncclCommGetAsyncError")
            rc = ctypes.c_int()
            self.lib.check(self.lib.lib.ncclCommGetAsyncError(self.handle, ctypes.byref(rc)),
                           "ncclCommGetAsyncError", self.handle)
            return rc.value

    def settle(self, what: str, *, deadline: float | None) -> None:
        """Wait until queued NCCL work has been handed to CUDA (the comm leaves ncclInProgress)."""
        state = {"rc": NCCL_IN_PROGRESS}

        def ready() -> bool:
            state["rc"] = self.async_error()
            return state["rc"] != NCCL_IN_PROGRESS

        poll_until(ready, deadline=deadline, aborted=self._aborted, what=what)
        if state["rc"] != NCCL_SUCCESS:
            raise NcclError(f"{what}: {self.lib.describe(state['rc'], self.handle)}")

    # -- operations (enqueued on a CUDA stream) ---------------------------------------------
    def group(self, recvs, sends, stream: int, *, deadline: float | None) -> None:
        """One NCCL group: receives ``(ptr, nbytes, peer)`` then sends, all on ``stream``."""
        L = self.lib.lib
        with self._lock:
            self._live("NCCL send/recv")
            self.lib.check(L.ncclGroupStart(), "ncclGroupStart")
            try:
                for ptr, nbytes, peer in recvs:
                    self.lib.check(L.ncclRecv(ptr, nbytes, UINT8, peer, self.handle, stream), "ncclRecv", self.handle)
                for ptr, nbytes, peer in sends:
                    self.lib.check(L.ncclSend(ptr, nbytes, UINT8, peer, self.handle, stream), "ncclSend", self.handle)
            finally:
                rc = L.ncclGroupEnd()
            self.lib.check(rc, "ncclGroupEnd", self.handle)
        if rc == NCCL_IN_PROGRESS:
            self.settle("NCCL send/recv", deadline=deadline)

    def broadcast(self, ptr: int, count: int, root: int, stream: int, *, deadline: float | None,
                  dtype: int = UINT8) -> None:
        """In-place ``ncclBroadcast`` of ``count`` elements of ``dtype`` (bytes by default)."""
        self._collective("ncclBroadcast", ptr, ptr, count, dtype, root, stream=stream, deadline=deadline)

    def all_reduce_f32(self, ptr: int, count: int, stream: int, *, deadline: float | None) -> None:
        self._collective("ncclAllReduce", ptr, ptr, count, FLOAT32, SUM, stream=stream, deadline=deadline)

    def _collective(self, name: str, *args: int, stream: int, deadline: float | None) -> None:
        """Enqueue NCCL's ``name(*args, comm, stream)`` on this comm; settle it if NCCL left it in progress."""
        with self._lock:
            self._live(name)
            rc = getattr(self.lib.lib, name)(*args, self.handle, stream)
            self.lib.check(rc, name, self.handle)
        if rc == NCCL_IN_PROGRESS:
            self.settle(name, deadline=deadline)

    # -- teardown ----------------------------------------------------------------------------
    def abort(self) -> None:
        """``ncclCommAbort``: terminates in-flight kernels whether or not the peers are alive.

        The owning group sets its abort flag first, so its pollers stop within a poll turn;
        the handle is cleared under the lock, so no thread can call NCCL on it afterwards.
        """
        with self._lock:
            handle, self.handle = self.handle, None
        if handle is not None:
            self.lib.lib.ncclCommAbort(handle)

    def abort_in_background(self, wait_s: float = 5.0) -> bool:
        """Abort from a helper thread, waiting at most ``wait_s``; True if it returned in time.

        Aborting a communicator whose init is still waiting for an absent peer may take
        as long as NCCL's bootstrap needs to notice; the caller must not hang on it.
        """
        t = threading.Thread(target=self.abort, name="refit-nccl-abort", daemon=True)
        t.start()
        t.join(wait_s)
        return not t.is_alive()


class NcclWork:
    """A stream-ordered NCCL operation: an event recorded after it on its stream."""

    polled = True  # refit.comm.group waits on it by polling, deadline- and abort-aware

    def __init__(self, event, comm: NcclComm, what: str, keep=None):
        self.event = event
        self.comm = comm
        self.what = what
        self._keep = keep  # tensors the operation reads or writes, kept alive until waited

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self, *, deadline: float | None, aborted: threading.Event) -> None:
        poll_until(self.event.query, deadline=deadline, aborted=aborted, what=self.what)
        self._keep = None


__all__ = [
    "NcclAborted", "NcclComm", "NcclError", "NcclLibrary", "NcclTimeout", "NcclWork", "find_library",
    "library", "make_config", "poll_until",
]
