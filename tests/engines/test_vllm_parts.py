"""The pure parts of the vLLM backend: the loader's view of a shard, the receive mode, the sealed channel."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.engines.vllm.extension import ReadWeightsState, new_key, open_sealed, seal
from refit.engines.vllm.served import PROBE_COLUMNS, probe_columns
from refit.engines.vllm.shard_tensor import CheckpointShard, as_checkpoint_tensor
from refit.engines.vllm.worker import VllmWorkerEndpoint, check_parallel_layout, choose_receive_mode
from refit.errors import InconsistentWeights, LayoutError, RefitError
from refit.layout import Shard, chunk_bounds, shard_slices


@settings(max_examples=300, deadline=None)
@given(width=st.integers(1, 1 << 20), salt=st.integers(0, 1 << 40))
def test_a_served_check_probes_the_same_number_of_columns_every_refit(width, salt):
    """A kernel builds its primitives per number of probe rows: a count that moved with the refit would
    rebuild them inside some refits' checks."""
    cols = probe_columns(width, salt)
    assert len(cols) == min(width, PROBE_COLUMNS) == len(set(cols))
    assert cols == sorted(cols) and cols[0] == 0 and cols[-1] == width - 1


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 12), tp=st.integers(1, 6), dim=st.integers(0, 1),
       data=st.data())
def test_a_loader_narrowing_to_the_workers_slice_gets_the_received_shard(rows, cols, tp, dim, data):
    rank = data.draw(st.integers(0, tp - 1))
    shape = (rows, cols)
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(shape)
    slices = shard_slices(shape, (tp,), (rank,), (Shard(dim),))
    shard = full[slices].clone()
    t = as_checkpoint_tensor(shard, shape, slices, "w")
    if tuple(shard.shape) == shape:
        assert t is shard
        return
    assert isinstance(t, CheckpointShard) and tuple(t.shape) == shape and t.dtype == shard.dtype
    lo, hi = chunk_bounds(shape[dim], tp, rank)
    # what vLLM's loaders do: narrow the full tensor to the worker's rows (or columns)
    assert t.narrow(dim, lo, hi - lo) is shard
    assert torch.equal(t.narrow(dim, lo, hi - lo), full.narrow(dim, lo, hi - lo))
    # the expert loader: a dummy expert dim, unbound again, then the narrow
    (one,) = t.unsqueeze(0).unbind()
    assert isinstance(one, CheckpointShard) and tuple(one.shape) == shape
    assert torch.equal(one.narrow(dim, lo, hi - lo), full.narrow(dim, lo, hi - lo))
    with pytest.raises(LayoutError, match=f"w: vLLM's loader unbinds dim {dim + 1}"):
        t.unsqueeze(0).unbind(dim + 1)
    if hi - lo and (lo > 0 or hi < shape[dim]):
        other = (lo + 1) % shape[dim]
        with pytest.raises(LayoutError, match="w: vLLM's loader asked for rows"):
            t.narrow(dim, other, 1)


def test_any_other_use_of_a_checkpoint_shard_raises_naming_it():
    shard = torch.ones(2, 4)
    t = CheckpointShard(shard, (4, 4), (slice(0, 2), slice(0, 4)), "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(LayoutError, match="up_proj.weight"):
        t.sum()
    with pytest.raises(LayoutError, match="up_proj.weight"):
        torch.zeros(4, 4).copy_(t)
    assert t.narrow(0, 0, 2) is shard


def test_receive_mode_choice_and_refusals():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert choose_receive_mode("auto", device=cpu, quantized=False) == "loader"
    assert choose_receive_mode("auto", device=gpu, quantized=False) == "direct"
    assert choose_receive_mode("auto", device=gpu, quantized=True) == "loader"
    assert choose_receive_mode("loader", device=gpu, quantized=False) == "loader"
    with pytest.raises(RefitError, match="needs a GPU engine"):
        choose_receive_mode("direct", device=cpu, quantized=False)
    with pytest.raises(RefitError, match="unquantized"):
        choose_receive_mode("direct", device=gpu, quantized=True)
    with pytest.raises(RefitError, match="receive_mode must be one of"):
        choose_receive_mode("fast", device=cpu, quantized=False)


class _Boom:
    def __reduce__(self):
        return (pytest.fail, ("a tampered message was unpickled",))


def test_sealed_messages_are_authenticated_before_they_are_unpickled():
    key = new_key()
    assert open_sealed(seal({0: ReadWeightsState()}, key), key) == {0: ReadWeightsState()}
    forged = b"\0" * 32 + pickle.dumps(_Boom())
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(forged, key)
    blob = bytearray(seal({"a": 1}, key))
    blob[-3] ^= 1
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(bytes(blob), key)
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(seal({"a": 1}, new_key()), key)


def test_pipeline_parallel_and_data_parallel_expert_engines_are_refused_by_name():
    from types import SimpleNamespace

    def layout(pp: int = 1, ep: bool = False, dp: int = 1):
        return SimpleNamespace(pipeline_parallel_size=pp, enable_expert_parallel=ep, data_parallel_size=dp)

    check_parallel_layout(layout())
    check_parallel_layout(layout(ep=True))
    with pytest.raises(RefitError, match="pipeline_parallel_size=2"):
        check_parallel_layout(layout(pp=2))
    with pytest.raises(RefitError, match="data_parallel_size=2"):
        check_parallel_layout(layout(ep=True, dp=2))


class _LoaderWithoutVllm(VllmWorkerEndpoint):
    """A loader-mode endpoint whose loaders are three layers of the test's, the second of which may fail."""

    def __init__(self, receive_mode: str = "loader"):
        self.receive_mode = receive_mode
        self.loads, self.last_load_s = 0, 0.0
        self.check_served = False  # no vLLM layers to run: the served check has its own real-engine tests
        self.layers = [0, 0, 0]
        self.fail_at: int | None = None
        self.told: list[str] = []

    def on_weights_inconsistent(self, reason: str) -> None:
        self.told.append(reason)

    def _run_loaders(self) -> None:
        for i in range(len(self.layers)):
            if i == self.fail_at:
                raise RuntimeError(f"out of memory loading layer {i}")
            self.layers[i] += 1


def test_a_vllm_load_that_fails_part_way_marks_the_worker_inconsistent_until_one_completes():
    ep = _LoaderWithoutVllm()
    assert not ep._refit_in_place()  # loader mode: a transfer lands in side buffers only
    assert _LoaderWithoutVllm("direct")._refit_in_place()
    assert ep.refit_weights_state()["consistent"]
    ep.fail_at = 1
    with pytest.raises(RuntimeError, match="layer 1"):
        ep.on_weights_loaded()
    assert ep.layers == [1, 0, 0]  # torn: layer 0 new, the others old
    state = ep.refit_weights_state()
    assert not state["consistent"] and "failed part way" in state["reason"] and "layer 1" in state["reason"]
    assert ep.told == ["vLLM's load of the received weights is running", state["reason"]]
    assert ep.loads == 0
    with pytest.raises(InconsistentWeights):
        ep.check_weights_consistent()
    ep.fail_at = None
    ep.on_weights_loaded()
    assert ep.refit_weights_state()["consistent"] and ep.layers == [2, 1, 1] and ep.loads == 1
    ep.check_weights_consistent()


class RoutedExperts(torch.nn.Module):
    """A layer with the class name, parameters and attributes of vLLM's stacked routed experts.

    ``ep_rank`` set: expert parallelism over ``tp`` workers, this one holding a contiguous run
    of whole experts (vLLM's linear placement); else every expert, its intermediate dim split.
    """

    def __init__(self, experts: int, hidden: int, inter: int, tp: int, *, ep_rank: int | None = None,
                 local_experts: int | None = None, gated: bool = True, padded_rows: int | None = None):
        super().__init__()
        from types import SimpleNamespace

        ep = ep_rank is not None
        rows = inter if ep else inter // tp
        local = experts // tp if ep else experts
        self.global_num_experts = experts
        self.local_num_experts = local if local_experts is None else local_experts
        self.hidden_size = hidden
        self.intermediate_size_per_partition = padded_rows or rows
        self.ckpt_gate_proj_name, self.ckpt_up_proj_name, self.ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"
        self.expert_map = torch.tensor([e - ep_rank * local if ep and e // local == ep_rank else -1
                                        for e in range(experts)]) if ep else None
        self.moe_config = SimpleNamespace(is_act_and_mul=gated, num_experts=experts, num_logical_experts=experts,
                                          intermediate_size_per_partition=rows, hidden_dim=hidden,
                                          moe_parallel_config=SimpleNamespace(tp_size=1 if ep else tp,
                                                                              ep_size=tp if ep else 1,
                                                                              ep_rank=ep_rank or 0))
        self.w13_weight = torch.nn.Parameter(torch.empty(self.local_num_experts, 2 * rows, hidden))
        self.w2_weight = torch.nn.Parameter(torch.empty(self.local_num_experts, hidden, rows))


def _moe_model(**kw) -> torch.nn.Module:
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = torch.nn.Module()
    model.mlp.experts.routed_experts = RoutedExperts(**kw)
    return model


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(1, 5), hidden=st.integers(1, 6), rows=st.integers(1, 4), tp=st.integers(1, 4),
       expert_parallel=st.booleans())
def test_routed_experts_land_where_vllms_expert_loader_puts_them(experts, hidden, rows, tp, expert_parallel):
    """Split by TP, each expert's gate/up/down shard is the slice vLLM's loader narrows to (``I // tp``
    rows at ``tp_rank * I // tp``) in the rows of ``w13_weight[e]`` / ``w2_weight[e]`` it copies them
    into. Under expert parallelism each expert is whole on the one worker whose slot holds it."""
    from refit.engines.vllm.destinations import plan_destinations
    from refit.layout import mesh_coords_of

    if expert_parallel:
        experts *= tp  # vLLM's linear placement: an equal run of experts per worker
    inter = rows if expert_parallel else rows * tp
    owners: dict[str, int] = {}
    for rank in range(tp):
        model = _moe_model(experts=experts, hidden=hidden, inter=inter, tp=tp,
                           ep_rank=rank if expert_parallel else None)
        dests = {d.name: d for d in plan_destinations(model, tp_rank=rank, tp_size=tp)}
        held = range(rank * (experts // tp), (rank + 1) * (experts // tp)) if expert_parallel else range(experts)
        assert sorted(dests) == sorted(f"mlp.experts.{e}.{m}.weight" for e in held
                                       for m in ("gate_proj", "up_proj", "down_proj"))
        for e in held:
            slot = e - held.start
            for member, dim, shape, target, where in (
                    ("gate_proj", 0, (inter, hidden), "w13_weight", (0, rows)),
                    ("up_proj", 0, (inter, hidden), "w13_weight", (rows, 2 * rows)),
                    ("down_proj", 1, (hidden, inter), "w2_weight", (0, hidden))):
                d = dests[f"mlp.experts.{e}.{member}.weight"]
                owners[d.name] = owners.get(d.name, 0) + 1
                assert (d.global_shape, d.expert, d.rows) == (shape, slot, where)
                assert d.target == f"mlp.experts.routed_experts.{target}"
                mesh = np.asarray(d.mesh)
                slices = shard_slices(d.global_shape, mesh.shape, mesh_coords_of(mesh, rank), d.placements)
                lo, hi = (0, inter) if expert_parallel else (rank * rows, (rank + 1) * rows)
                assert (slices[dim].start, slices[dim].stop) == (lo, hi)
                assert slices[1 - dim] == slice(0, shape[1 - dim])
                assert d.local_shape == tuple(s.stop - s.start for s in slices)
    # every expert is received: once (EP) or by every worker (TP)
    assert set(owners.values()) == {1 if expert_parallel else tp} and len(owners) == 3 * experts


def test_experts_vllm_lays_out_otherwise_are_refused_by_name():
    from refit.engines.vllm.destinations import plan_destinations

    cases = [(dict(local_experts=2), "holds 2 of 4 experts without expert parallelism"),
             (dict(gated=False), "ungated experts"),
             (dict(padded_rows=8), "padded")]
    for kw, message in cases:
        with pytest.raises(LayoutError, match=message) as info:
            plan_destinations(_moe_model(experts=4, hidden=4, inter=6, tp=2, **kw), tp_rank=0, tp_size=2)
        assert "mlp.experts.routed_experts.w13_weight" in str(info.value)
    biased = _moe_model(experts=4, hidden=4, inter=6, tp=2)
    biased.mlp.experts.routed_experts.w13_bias = torch.nn.Parameter(torch.empty(4, 6))
    with pytest.raises(LayoutError, match="w13_bias"):
        plan_destinations(biased, tp_rank=0, tp_size=2)
