"""The NIXL transport on real processes over UCX on host memory.

The same property test as the gloo path (random meshes, placements, shapes and dtypes,
every destination checked against its expected slice), plus: no collective call on the
refit path, a node joining a running fleet, a receiver killed mid-refit and a dead
source, each followed by a refit over the new membership that completes and verifies.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings

from refit.transport.nixl import nixl_available

if not nixl_available():
    pytest.skip("NIXL is not installed (pip install 'refit[nixl]')", allow_module_level=True)

from helpers import nixl_jobs as J  # noqa: E402

from refit import Replicate, Shard  # noqa: E402
from refit.testing.launch import scaled

WORLD = 4
# far above how long noticing a dead peer takes on a busy machine, so "< DEADLINE_S" means noticed
DEADLINE_S = scaled(30.0)
_epochs = itertools.count(1)


@pytest.fixture(scope="module")
def procs():
    """Four processes for the whole module (process start dominates on a small machine); the
    test that kills ranks runs last."""
    # a small in-place threshold, so the tiny tensors of the cases take the zero-copy path too
    with J.environment(REFIT_DIRECT_BYTES="64"):
        P = J.Procs(WORLD)
    with P:
        yield P


@pytest.mark.timeout(120)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(J.transfer_cases(WORLD, chunks=True))
def test_nixl_reshard_matches_expected(procs, case):
    """Same plans as gloo, moved by NIXL WRITEs: every destination gets exactly its slice,
    twice in a row (in-place and replaced source tensors), after one handshake."""
    epoch = next(_epochs)
    infos = procs.ok(J.setup, case, epoch, exchange="group")
    assert all(i["handshake_calls"] == ["all_gather_object"] for i in infos.values())
    for step in (0, 1):
        results = procs.ok(J.refit_step, step, replace_src=bool(step))
        J.check_refits(results, case)
        # what each source sent is what its receivers got, bucket by bucket
        for r, res in results.items():
            for (peer, idx), value in res["sent"].items():
                assert results[peer]["received"][(r, idx)] == value


@pytest.mark.timeout(60)
def test_no_collective_on_the_refit_path(procs):
    """One all_gather_object at the handshake; none in any of the refits after it, on any rank."""
    S, R = Shard, Replicate
    case = {"world": WORLD, "bucket_bytes": 64, "chunk_bytes": 128, "params": [
        {"name": "w", "shape": (12, 10), "seed": 5, "src_mesh": [0, 1], "src_pl": [S(0)], "src_dtype": "float32",
         "dst_mesh": [[2], [3]], "dst_pl": [R(), S(1)], "dst_dtype": "bfloat16"},
        {"name": "b", "shape": (33,), "seed": 6, "src_mesh": [[0, 1], [2, 3]], "src_pl": [R(), S(0)],
         "src_dtype": "float32", "dst_mesh": [3, 1], "dst_pl": [S(0)], "dst_dtype": "float32"},
    ]}
    before = procs.ok(_collectives)
    infos = procs.ok(J.setup, case, next(_epochs), exchange="group")
    after_handshake = procs.ok(_collectives)
    assert {r: after_handshake[r] - before[r] for r in before} == {r: 1 for r in range(WORLD)}
    assert all(i["handshake_calls"] == ["all_gather_object"] for i in infos.values())
    for step in range(5):
        J.check_refits(procs.ok(J.refit_step, step), case)
    assert procs.ok(_collectives) == after_handshake
    last = procs.ok(J.refit_step, 5)
    assert {r: v["seq"] for r, v in last.items()} == {r: 6 for r in range(WORLD)}  # notifications carried 0..5


def _collectives(group):
    J.count_collectives()
    return J.collectives()


def _case_engines(src_mesh, engines, shape=(16, 12), twin=False):
    """A trainer layout and one data-parallel engine per entry of ``engines`` (rank lists).

    ``twin`` adds a second param of ``w``'s shape and layouts: replicas take contiguous windows
    of a group's bytes, so with a single consumer the twins come from different replicas.
    """
    S, R = Shard, Replicate
    dsts_w = [{"mesh": e, "pl": [S(0)], "dtype": "bfloat16" if i % 2 else "float32"} for i, e in enumerate(engines)]
    dsts_v = [{"mesh": e, "pl": [R()], "dtype": "float32"} for e in engines]
    twins = [{"name": "w_twin", "shape": shape, "seed": 14, "src_mesh": src_mesh, "src_pl": [R()],
              "src_dtype": "float32", "dsts": dsts_w}] if twin else []
    return {"bucket_bytes": 96, "chunk_bytes": 160, "params": twins + [
        {"name": "w", "shape": shape, "seed": 11, "src_mesh": src_mesh, "src_pl": [R()], "src_dtype": "float32",
         "dsts": dsts_w},
        {"name": "v", "shape": (40,), "seed": 12, "src_mesh": src_mesh, "src_pl": [R()], "src_dtype": "float32",
         "dsts": dsts_v},
        # (a replicated source serves whole params from alternating replicas: x comes from the second)
        {"name": "x", "shape": (8, 5), "seed": 13, "src_mesh": src_mesh, "src_pl": [R()], "src_dtype": "float32",
         "dsts": dsts_v},
    ]}


@pytest.mark.timeout(60)
def test_handshake_errors_are_clear(procs):
    """Receive buffers that moved without a new handshake, a stale roster, and a roster
    without a peer of the plan are refused with errors that say what to do."""
    P = procs
    case = _case_engines([0], [[1]])
    J.relay_membership(P, case, [0, 1], next(_epochs))
    J.refit_ranks(P, 0, [0, 1])
    res = P.ok(_moved_destination, ranks=[1])[1]
    assert res[0] == "NixlHandshakeError" and "registered again" in res[1], res
    res = P.ok(_roster_without_peer, ranks=[0])[0]
    assert res[0] == "NixlHandshakeError" and "lacks rank(s) [1]" in res[1], res
    J.relay_membership(P, case, [0, 1], next(_epochs))
    J.refit_ranks(P, 1, [0, 1])


@pytest.mark.timeout(2 * 3 * DEADLINE_S + 60)
def test_join_dead_receiver_dead_source(procs):
    """A node joins a running fleet; a receiver and then a source die mid-refit; each time the
    survivors fail fast naming the dead peer, and the refit over the new membership verifies.
    (Runs last: it kills two of the module's processes.)"""
    P = procs
    e = next(_epochs)
    P.ok(J.close, ranks=[3])  # rank 3 starts with no NIXL agent: a node that joins later
    # a trainer (rank 0) and two data-parallel engines
    case = _case_engines([0], [[1], [2], [3]])
    a = J.relay_membership(P, case, [0, 1, 2], e)
    J.refit_ranks(P, 0, [0, 1, 2])
    J.refit_ranks(P, 1, [0, 1, 2])
    # an engine joins the running fleet: relayed roster, nothing collective, in step at once
    b = J.relay_membership(P, case, [0, 1, 2, 3], e + 1)
    assert b[0]["plan_key"] != a[0]["plan_key"] and b[0]["plan_key"][0] == 4  # the world grew: a new plan
    assert b[0]["agent"] == a[0]["agent"]  # the running nodes keep their agents
    res = J.refit_ranks(P, 2, [0, 1, 2, 3])
    assert res[3]["seq"] == 1 and res[3]["epoch"] == e + 1
    # engine 2 dies in the middle of the next refit: its source names it, within the deadline
    res = J.refit_losing(P, 3, [0, 1, 2, 3], 2, DEADLINE_S)
    J.aborted_naming(res, 0, 2, DEADLINE_S)
    for r in (1, 3):  # the other engines got their weights all the same
        assert res[r][1]["error"] is None and res[r][1]["all_ok"], res[r]
    # the membership without it: the next refit completes and verifies
    J.relay_membership(P, case, [0, 1, 3], e + 2)
    J.refit_ranks(P, 4, [0, 1, 3])
    # rank 1 becomes a second trainer replica; replicas share the load, so engine 3 reads from both
    case = _case_engines([0, 1], [[3]], shape=(24, 16), twin=True)
    infos = J.relay_membership(P, case, [0, 1, 3], e + 3)
    assert infos[3]["peers"] == [0, 1]
    J.refit_ranks(P, 5, [0, 1, 3])
    # the second replica dies mid-refit: its receiver names it, the other source completes
    res = J.refit_losing(P, 6, [0, 1, 3], 1, DEADLINE_S)
    J.aborted_naming(res, 3, 1, DEADLINE_S)
    assert res[0][1]["error"] is None
    # without the dead replica the survivor serves everything
    J.relay_membership(P, _case_engines([0], [[3]], shape=(24, 16), twin=True), [0, 3], e + 4)
    J.refit_ranks(P, 7, [0, 3])


def _moved_destination(group):
    """A refit given destinations that moved: the executor rebinds to them, which changes this
    rank's receive descriptors, so it refuses to run until a new handshake relays them."""
    import torch

    ex = J._S["executor"]
    dst = {n: torch.empty_like(v) for n, v in J._S["dst"].items()}
    try:
        ex.run(J._S["src"], dst, verify=True)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        ex.prepare(J._S["src"], J._S["dst"])
    return None


def _roster_without_peer(group):
    t = J._S["transport"]
    try:
        t.update_membership({0: t.local_roster_entry()}, t.epoch + 1)
    except Exception as e:
        return type(e).__name__, str(e)
    return None
