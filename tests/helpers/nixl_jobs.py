"""Functions run on the ranks of the NIXL tests, and a small process harness that survives a dead rank.

Every rank derives the rosters of a case by itself (the case says who holds and needs
what), so building the plan needs no communication; the only collective any NIXL test
uses is the one-time handshake of ``NixlChannel.handshake(group)``, and the tests count
that. The state of a rank (its transport, tensors and the collective counter) lives in
this module for the life of its process (its channel as ``transport``, its plan's executor as
``executor``).
"""

from __future__ import annotations

import os
import time
from typing import Any
from unittest import mock

import numpy as np
import torch

from helpers.layouts import full_tensor, local_slice
from refit.plan import RosterEntry, build_rank_plan, merge_rosters
from refit.testing.launch import LocalFleet, serve_requests

_S: dict[str, Any] = {}

COLLECTIVES = ("all_gather_object", "broadcast_object", "broadcast", "barrier", "isend", "irecv", "p2p_group",
               "split", "all_reduce", "all_gather", "send", "recv", "batch_isend_irecv", "gather_object",
               "scatter_object_list", "reduce")


# -- counting every collective a process makes -----------------------------------------------

def count_collectives() -> dict[str, int]:
    """Wrap every communication call of ``StatelessProcessGroup``, ``TorchGroupComm`` and
    ``torch.distributed`` in this process with a counter (once); return the counter."""
    counts = _S.get("collectives")
    if counts is not None:
        return counts
    counts = _S["collectives"] = {}
    import torch.distributed as dist

    from refit.comm import group as comm
    def wrap(owner, name, label):
        fn = getattr(owner, name, None)
        if fn is None or getattr(fn, "_counted", False):
            return

        def counted(*args, **kwargs):
            counts[label] = counts.get(label, 0) + 1
            return fn(*args, **kwargs)

        counted._counted = True
        setattr(owner, name, counted)

    for cls in (comm.StatelessProcessGroup, comm.TorchGroupComm):
        for name in COLLECTIVES:
            wrap(cls, name, f"{cls.__name__}.{name}")
    for name in COLLECTIVES:
        wrap(dist, name, f"torch.distributed.{name}")
    return counts


def collectives() -> int:
    return sum(count_collectives().values())


# -- cases ------------------------------------------------------------------------------------------

def environment(**values):
    """``os.environ`` with ``values`` set inside the block (the processes it starts inherit them)."""
    return mock.patch.dict(os.environ, values)


def transfer_cases(world: int, *, chunks: bool = False):
    """A hypothesis strategy: one or two params, each from a random layout over ``world`` ranks to
    another, with casts (``chunks``: also NIXL's bytes per WRITE)."""
    from hypothesis import strategies as st

    from helpers.layouts import meshes, placements_for, shapes

    @st.composite
    def cases(draw):
        params = []
        for i in range(draw(st.integers(1, 2))):
            shape = draw(shapes(max_ndim=3, max_size=9))
            sm = draw(meshes(list(range(world))))
            dm = draw(meshes(list(range(world))))
            params.append({
                "name": f"p{i}", "shape": shape, "seed": draw(st.integers(0, 1000)),
                "src_mesh": sm.tolist(), "src_pl": draw(placements_for(sm.ndim, len(shape))),
                "src_dtype": draw(st.sampled_from(["float32", "bfloat16", "float64"])),
                "dst_mesh": dm.tolist(), "dst_pl": draw(placements_for(dm.ndim, len(shape))),
                "dst_dtype": draw(st.sampled_from(["float32", "bfloat16"])),
            })
        case = {"world": world, "params": params, "bucket_bytes": draw(st.sampled_from([16, 96, 1 << 20]))}
        if chunks:
            case["chunk_bytes"] = draw(st.sampled_from([1, 200, 1 << 20]))
        return case

    return cases()

def _dsts(p, members=None):
    """A param's destination layouts: ``dsts`` (a list of {mesh, pl, dtype}) or one ``dst_*``
    layout; with ``members``, only the layouts whose ranks are all members."""
    dsts = p.get("dsts") or [{"mesh": p["dst_mesh"], "pl": p["dst_pl"], "dtype": p["dst_dtype"]}]
    if members is not None:
        dsts = [d for d in dsts if set(np.array(d["mesh"]).reshape(-1).tolist()) <= set(members)]
    return dsts


def rosters(case, members) -> dict[int, list[RosterEntry]]:
    out: dict[int, list[RosterEntry]] = {r: [] for r in members}
    for p in case["params"]:
        mesh = np.array(p["src_mesh"])
        for r in mesh.reshape(-1).tolist():
            out[r].append(RosterEntry.make(p["name"], p["shape"], p["src_dtype"], mesh.tolist(), p["src_pl"], "src"))
        for d in _dsts(p, members):
            mesh = np.array(d["mesh"])
            for r in mesh.reshape(-1).tolist():
                out[r].append(RosterEntry.make(p["name"], p["shape"], d["dtype"], mesh.tolist(), d["pl"], "dst"))
    return out


def _dst_layout(p, rank, members):
    for d in _dsts(p, members):
        if rank in np.array(d["mesh"]).reshape(-1).tolist():
            return d
    return None


def _slices(case, rank, step, members):
    src, want = {}, {}
    for p in case["params"]:
        full = full_tensor(p["shape"], p["seed"] + 7919 * step).to(getattr(torch, p["src_dtype"]))
        s = local_slice(full, np.array(p["src_mesh"]), p["src_pl"], rank)
        if s is not None:
            src[p["name"]] = s
        d = _dst_layout(p, rank, members)
        if d is not None:
            want[p["name"]] = local_slice(full.to(getattr(torch, d["dtype"])), np.array(d["mesh"]), d["pl"], rank)
    return src, want


class Counting:
    """A process-group proxy that counts what is called through it."""

    def __init__(self, group):
        self._group = group
        self.calls: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._group, name)
        if callable(attr):
            def call(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)
            return call
        return attr


def setup(group, case, epoch, *, members=None, exchange="relay", timeout_s=20.0, chunk_bytes=None, direct=True,
          transport="nixl", device="cpu"):
    """(Re)build this rank's plan for ``case`` over ``members`` and register its buffers.

    ``transport``: ``"nixl"`` (a ``NixlChannel``) or ``"ipc"`` (an ``IpcChannel``), kept across
    setups as an endpoint keeps it across builds, with a new executor for each plan;
    ``device="cuda"``: this rank's tensors on GPU ``rank % GPUs`` (ranks share GPUs).

    ``exchange="group"``: the one-time handshake through the fleet's process group (counted);
    ``"relay"``: return the roster entry for the controller (the test) to relay.
    """
    from refit.transport.factory import make_executor
    from refit.transport.ipc import IpcChannel
    from refit.transport.nixl import NixlChannel

    rank = group.rank
    count_collectives()
    members = sorted(members) if members is not None else list(range(case["world"]))
    if rank not in members:
        return None
    world = case.get("world") or max(members) + 1  # a fleet that grows is a larger world
    index = merge_rosters(rosters(case, members), world)
    plan = build_rank_plan(index, rank, bucket_bytes=case.get("bucket_bytes", 64 << 20))
    t = _S.get("transport")
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", rank % torch.cuda.device_count())
    if t is None and transport == "ipc":
        t = _S["transport"] = IpcChannel(rank, device=dev, timeout_s=timeout_s)
    if t is None:
        t = _S["transport"] = NixlChannel(rank, device=dev, timeout_s=timeout_s,
                                          chunk_bytes=chunk_bytes or case.get("chunk_bytes", 1 << 20), direct=direct)
    src, want = _slices(case, rank, 0, members)
    src = {n: v.to(dev) for n, v in src.items()}
    dst = {n: torch.full(w.shape, float("nan"), dtype=w.dtype, device=dev) for n, w in want.items()}
    _S.update(case=case, src=src, dst=dst, plan=plan, members=members, device=dev)
    old = _S.get("executor")
    ex = _S["executor"] = make_executor(plan, transport=t.transport, **{t.transport: t})
    ex.prepare(src, dst)
    if old is not None:
        old.close()
    info = {"rank": rank, "plan_key": plan.key, "agent": getattr(t, "agent_name", None) or t.name,
            "peers": plan.peers(),
            "sends": len(plan.sends), "recvs": len(plan.recvs)}
    if exchange == "group":
        proxy = Counting(group)
        t.handshake(proxy, epoch=epoch)
        info["handshake_calls"] = list(proxy.calls)
        return info
    info["entry"] = t.local_roster_entry()
    return info


def install(group, roster, epoch):
    t = _S.get("transport")
    if t is None or group.rank not in roster:
        return None
    before = collectives()
    t.update_membership(roster, epoch)
    return {"collectives": collectives() - before, "epoch": t.epoch}


def refit_step(group, step, *, timeout_s=60.0, fault=None, replace_src=None, freeze_s=0.0, verify=None):
    """One refit of the installed plan with the data of ``step``; check every destination.

    ``fault="die"``: this rank's process exits at once, in the middle of the refit (its
    peers are already in it). ``replace_src``: give new source tensors (default: every
    other step) instead of writing into the registered ones. ``verify``: whether this refit
    takes checksums (None: it does).
    """
    from refit.runtime.watchdog import RefitAborted, RefitAbortWatchdog

    t = _S.get("transport")
    if t is None or _S.get("plan") is None or t.epoch < 0:
        return None
    rank = group.rank
    case = _S["case"]
    if fault == "die":
        os._exit(17)
    if fault == "freeze":  # alive but stuck: its peers must name it at their deadline
        time.sleep(freeze_s)
        return {"rank": rank, "error": "frozen"}
    new_src, want = _slices(case, rank, step, _S["members"])
    dev = _S.get("device", torch.device("cpu"))
    new_src = {n: v.to(dev) for n, v in new_src.items()}
    want = {n: v.to(dev) for n, v in want.items()}
    replace = (step % 2 == 1) if replace_src is None else replace_src
    src = _S["src"]
    for name, v in new_src.items():
        if replace:
            src[name] = v
        else:
            src[name].copy_(v)
    dst = _S["dst"]
    for v in dst.values():
        v.fill_(float("nan"))
    before = collectives()
    t0 = time.monotonic()
    try:
        with RefitAbortWatchdog([t], timeout_s):
            stats = _S["executor"].run(src, dst, verify=True if verify is None else verify)
    except RefitAborted as e:
        return {"rank": rank, "error": "RefitAborted", "message": str(e), "elapsed": time.monotonic() - t0,
                "collectives": collectives() - before,
                "ok": {n: bool(torch.equal(dst[n], w)) for n, w in want.items()}}
    ok = {n: bool(torch.equal(dst[n], w)) for n, w in want.items()}
    return {"rank": rank, "error": None, "ok": ok, "all_ok": all(ok.values()), "elapsed": time.monotonic() - t0,
            "collectives": collectives() - before, "seq": t.seq, "epoch": t.epoch,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
            "zero_copy": stats.zero_copy_buckets, "sent": dict(stats.checksums_sent),
            "received": dict(stats.checksums_received)}


def close(group):
    ex = _S.pop("executor", None)
    if ex is not None:
        ex.close()
    t = _S.pop("transport", None)
    if t is not None:
        t.close()
    return True


# -- the controller's side, from the test ---------------------------------------------------------

def check_refits(results, case=None):
    """Every rank of one refit: no error, every destination exact, no collective."""
    for r, res in results.items():
        assert res["error"] is None, (r, res)
        assert res["all_ok"], (r, res["ok"], case)
        assert res["collectives"] == 0, (r, res)


def relay_membership(procs, case, members, epoch, **setup_kwargs):
    """What a controller does at a build: each member rebuilds its plan and reports its roster
    entry; the roster goes back to every member. No collective anywhere."""
    infos = procs.ok(setup, case, epoch, members=members, ranks=members, **setup_kwargs)
    roster = {r: i["entry"] for r, i in infos.items()}
    installed = procs.ok(install, roster, epoch, ranks=members)
    assert all(v["collectives"] == 0 for v in installed.values())
    return infos


def refit_losing(procs, step, ranks, dead, deadline_s, **kwargs):
    """One refit on ``ranks`` in which rank ``dead`` dies; the others run it with ``deadline_s`` and
    ``kwargs``. The results by rank, the death checked."""
    res = procs.call(refit_step, step, ranks=ranks, timeout_s=deadline_s * 3,
                     per_rank={r: {"timeout_s": deadline_s, **kwargs} for r in ranks} | {dead: {"fault": "die"}})
    assert res[dead][0] == "dead"
    return res


def aborted_naming(res, rank, dead, deadline_s) -> dict:
    """Rank ``rank``'s result of ``refit_losing``: aborted within ``deadline_s``, naming the dead rank."""
    out = res[rank][1]
    assert out["error"] == "RefitAborted" and f"rank {dead}" in out["message"], out
    assert out["elapsed"] < deadline_s
    return out


def refit_ranks(procs, step, ranks, **kwargs):
    """One refit on ``ranks``, checked with ``check_refits``; the results by rank."""
    res = procs.ok(refit_step, step, ranks=ranks, **kwargs)
    check_refits(res)
    return res


# -- a process harness that outlives a dead rank -------------------------------------------------

def _main(rank, n, port, secret, conn):
    torch.set_num_threads(1)
    from refit.comm.group import StatelessProcessGroup

    group = StatelessProcessGroup("127.0.0.1", port, rank, n, timeout_s=60, secret=secret)
    try:
        serve_requests(conn, lambda fn, args, kwargs: fn(group, *args, **kwargs))
    finally:
        close(group)
        group.abort()
        conn.close()


class Procs(LocalFleet):
    """A ``LocalFleet`` of gloo ranks (the group serves the one-time handshake) whose calls report
    a rank that dies instead of failing the fleet."""

    def __init__(self, n: int):
        self.dead: set[int] = set()
        self._start(n, _main, (), 120.0)

    @property
    def size(self) -> int:
        return len(self._procs)

    def call(self, fn, *args, ranks=None, timeout_s: float = 60.0, per_rank=None, **kwargs) -> dict[int, Any]:
        """Run ``fn(group, *args, **kwargs)`` on ``ranks`` (default: the living); ``per_rank``
        maps a rank to extra kwargs. Returns rank -> ("ok", value) / ("err", (type, traceback)) / ("dead", code)."""
        ranks = [r for r in range(len(self._procs)) if r not in self.dead] if ranks is None else list(ranks)
        for r in ranks:
            self._conns[r].send((r, fn, args, {**kwargs, **((per_rank or {}).get(r, {}))}))
        replies, late = self._replies(ranks, timeout_s)
        if late:
            raise TimeoutError(f"ranks {late} did not answer within {timeout_s}s")
        out: dict[int, Any] = {}
        for r, reply in replies.items():
            if reply is None:
                self._procs[r].join(5)
                self.dead.add(r)
                out[r] = ("dead", self._procs[r].exitcode)
            else:
                out[r] = ("ok" if reply[0] else "err", reply[1])
        return out

    def ok(self, fn, *args, **kwargs) -> dict[int, Any]:
        res = self.call(fn, *args, **kwargs)
        bad = {r: v for r, v in res.items() if v[0] != "ok"}
        if bad:
            raise AssertionError("; ".join(f"rank {r}: {v[1][1] if v[0] == 'err' else v}" for r, v in bad.items()))
        return {r: v[1] for r, v in res.items()}
