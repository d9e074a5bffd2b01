"""The pure parts of the vLLM backend: the loader's view of a shard, the receive mode, the sealed channel."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.engines.vllm.extension import new_key, open_sealed, seal
from refit.engines.vllm.shard_tensor import CheckpointShard, as_checkpoint_tensor
from refit.engines.vllm.worker import VllmWorkerEndpoint, check_parallel_layout, choose_receive_mode
from refit.errors import InconsistentWeights, LayoutError, RefitError
from refit.layout import Shard, chunk_bounds, shard_slices


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
    assert open_sealed(seal(("refit_ping", {0: ((), {})}), key), key) == ("refit_ping", {0: ((), {})})
    forged = b"\0" * 32 + pickle.dumps(_Boom())
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(forged, key)
    blob = bytearray(seal({"a": 1}, key))
    blob[-3] ^= 1
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(bytes(blob), key)
    with pytest.raises(RefitError, match="failed authentication"):
        open_sealed(seal({"a": 1}, new_key()), key)


def test_pipeline_and_expert_parallel_engines_are_refused_by_name():
    from types import SimpleNamespace

    check_parallel_layout(SimpleNamespace(pipeline_parallel_size=1, enable_expert_parallel=False))
    with pytest.raises(RefitError, match="pipeline_parallel_size=2"):
        check_parallel_layout(SimpleNamespace(pipeline_parallel_size=2, enable_expert_parallel=False))
    with pytest.raises(RefitError, match="enable_expert_parallel"):
        check_parallel_layout(SimpleNamespace(pipeline_parallel_size=1, enable_expert_parallel=True))


class _LoaderWithoutVllm(VllmWorkerEndpoint):
    """A loader-mode endpoint whose loaders are three layers of the test's, the second of which may fail."""

    def __init__(self, receive_mode: str = "loader"):
        self.receive_mode = receive_mode
        self.loads, self.last_load_s = 0, 0.0
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
