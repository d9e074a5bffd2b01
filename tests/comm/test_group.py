"""The stateless process group on gloo (NCCL in gpu/test_gpu.py): collectives, split groups, abort, arguments."""

from __future__ import annotations

import pickle
import sys
import types

import pytest
import torch
from helpers import comm_jobs

from refit.comm.group import StatelessProcessGroup, free_port, pickle_vllm_unique_id
from refit.errors import RefitError

WORLD = FLEET_SIZE = 4


def test_gloo_basics(fleet):
    out = fleet.run(comm_jobs.gloo_basics)
    for r, o in enumerate(out):
        assert o["gathered"] == [{"rank": i} for i in range(WORLD)]
        assert o["broadcast"] == [float(WORLD - 1)] * 3
        assert o["ring"] == [10.0 + (r - 1) % WORLD] * 4


def test_split_children_are_aborted_first(fleet):
    out = fleet.run(comm_jobs.split_and_abort, timeout_s=60)
    for r, o in enumerate(out):
        assert o["members"] == [i for i in range(WORLD) if i % 2 == r % 2]
        assert o["child_rank"] == r // 2 and o["child_world"] == WORLD // 2
        assert o["gathered"] == o["members"]
        assert o["child_broadcast"] == [float(o["members"][0])] * 2
        assert o["order"] == ["child", "parent-done"] and o["child_aborted"]
    # the fleet's groups are aborted now: rebuild the fleet for any later test in this module


def test_abort_is_idempotent_and_safe_unbuilt():
    g = StatelessProcessGroup("127.0.0.1", free_port(), 0, 1)
    g.abort()
    g.abort()
    assert g.aborted and g.store is None and "aborted" in repr(g)
    with pytest.raises(Exception, match="aborted"):
        g.all_gather_object(1)
    never = object.__new__(StatelessProcessGroup)
    never._init_state("refit", 0, 1, "gloo", 1.0)
    never.abort()  # a group whose rendezvous never happened
    assert never.aborted


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nccl_backend_without_gpu_is_a_clear_error():
    port = free_port()
    with pytest.raises(RefitError, match="needs a CUDA device"):
        StatelessProcessGroup("127.0.0.1", port, 0, 1, backend="nccl")
    StatelessProcessGroup("127.0.0.1", port, 0, 1).abort()  # the store was dropped: the port is free again


def test_bad_arguments():
    with pytest.raises(RefitError, match="outside world size"):
        StatelessProcessGroup("127.0.0.1", free_port(), 2, 2)
    with pytest.raises(RefitError, match="backend"):
        StatelessProcessGroup("127.0.0.1", free_port(), 0, 1, backend="mpi")
    with pytest.raises(RefitError, match="peer"):
        StatelessProcessGroup("127.0.0.1", free_port(), 0, 1, peer="sglang")


def test_vllm_unique_id_wire_format(monkeypatch):
    raw = bytes(range(128))
    loaded = {m for m in sys.modules if m.startswith("vllm")}  # the real vLLM, when another test imported it
    blob = pickle_vllm_unique_id(raw)
    assert {m for m in sys.modules if m.startswith("vllm")} == loaded, "fake modules are removed again"
    # unpickle the way a vLLM rank does: with vLLM's own ctypes type under its module name
    import ctypes

    name = "vllm.distributed.device_communicators.pynccl_wrapper"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__ = name
    ncclUniqueId.__qualname__ = "ncclUniqueId"
    sys.modules[name].ncclUniqueId = ncclUniqueId
    uid = pickle.loads(blob)
    assert type(uid) is ncclUniqueId and bytes(uid.internal) == raw
    assert pickle_vllm_unique_id(raw) == blob, "with vLLM loaded, its own type gives the same bytes"
    with pytest.raises(RefitError, match="128 bytes"):
        pickle_vllm_unique_id(b"short")
