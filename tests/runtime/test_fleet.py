"""Endpoints and the synthetic model, without Ray (the Ray fleet is exercised in test_recovery_ray.py)."""

import pytest
import torch

import refit
from refit.errors import LayoutError
from refit.runtime.handles import process_resources
from refit.runtime.shards import LocalShard, as_local_shard
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer, synthetic_param, synthetic_shapes


def test_local_shard_forms():
    t = torch.zeros(2, 3)
    a = as_local_shard("w", (t, (4, 3), [0, 1], [refit.Shard(0)]))
    b = as_local_shard("w", (refit.DTensorRef(t, (4, 3)), [0, 1], refit.Shard(0)))
    c = as_local_shard("w", a)
    assert a == c and b.global_shape == (4, 3) and b.placements == (refit.Shard(0),) and b.tensor is t
    assert isinstance(a, LocalShard)
    with pytest.raises(LayoutError, match="w: expected"):
        as_local_shard("w", t)
    with pytest.raises(LayoutError, match="must start with a DTensorRef"):
        as_local_shard("w", (t, [0], [refit.Shard(0)]))


def test_synthetic_model_is_deterministic_and_step_dependent():
    shapes = synthetic_shapes(16, 1)
    name = "layers.0.qkv_proj.weight"
    assert torch.equal(synthetic_param(name, shapes[name], 3), synthetic_param(name, shapes[name], 3))
    assert not torch.equal(synthetic_param(name, shapes[name], 3), synthetic_param(name, shapes[name], 4))
    trainers = [SyntheticTrainer(r, 2, hidden=16, layers=1) for r in range(2)]
    full = torch.cat([trainers[r].params[name] for r in range(2)], dim=0)
    assert torch.equal(full, synthetic_param(name, shapes[name], 0))
    engine = SyntheticEngine(0, 1, 2, hidden=16, layers=1)
    assert name in engine.check_weights(0)  # zeros until weights land
    for n, (t, shape, mesh, _placements) in engine.refit_destinations().items():
        assert t.dtype == torch.bfloat16 and mesh == [0, 1] and tuple(shape) == shapes[n]


def test_endpoint_without_tensors_says_what_to_implement():
    class Bare(refit.EngineEndpoint):
        pass

    with pytest.raises(NotImplementedError, match="Bare must implement refit_destinations"):
        Bare().refit_destinations()
    assert Bare().refit_ping()["pid"] > 0


def test_process_resources_sees_a_listening_socket():
    import socket

    before = process_resources()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        during = process_resources()
    assert port in during["listening_ports"] and port not in before["listening_ports"]
    assert during["fds"] == before["fds"] + 1 and during["threads"] >= 1
