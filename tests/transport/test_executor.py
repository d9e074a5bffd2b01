"""The executor contract: made once with its plan, bound to tensors once, reused; the factory's choices."""

from __future__ import annotations

import pytest
import torch

from refit import Replicate, Shard
from refit.comm.group import StatelessProcessGroup, free_port
from refit.errors import PlanError
from refit.plan import RosterEntry, build_rank_plan, merge_rosters
from refit.transport import make_executor
from refit.transport.broadcast import BroadcastExecutor, BroadcastPlan
from refit.transport.fanout import FanoutExecutor
from refit.transport.rounds import RoundsExecutor
from refit.transport.streamed import StreamedExecutor


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group: every block of a one-rank plan is a local copy, so nothing waits on a peer."""
    g = StatelessProcessGroup("127.0.0.1", free_port(), 0, 1, backend="gloo", timeout_s=30)
    yield g
    g.abort()


def one_rank_plan(fanout: bool = False):
    rosters = {0: [RosterEntry.make("w", (6, 4), "float32", [0], [Replicate()], "src"),
                   RosterEntry.make("w", (6, 4), "bfloat16", [0], [Shard(0)], "dst")]}
    index = merge_rosters(rosters, 1)
    return index, build_rank_plan(index, 0, fanout=fanout)


def test_an_executor_is_bound_once_and_rebinds_only_to_other_tensors(group):
    _, plan = one_rank_plan()
    src, dst = {"w": torch.randn(6, 4)}, {"w": torch.zeros(6, 4, dtype=torch.bfloat16)}
    ex = make_executor(plan, group)
    assert isinstance(ex, RoundsExecutor)
    ex.prepare(src, dst)
    binding = ex.binding
    for step in range(3):
        src["w"].copy_(torch.full((6, 4), float(step)))  # weights change in place, as after an optimizer step
        stats = ex.run(src, dst)
        assert torch.equal(dst["w"], src["w"].to(torch.bfloat16))
        assert stats.local_bytes == 6 * 4 * 2
        assert ex.binding is binding, "the same tensors: no rebind"
    replaced = {"w": torch.randn(6, 4)}  # a trainer that swaps its parameter tensors
    ex.run(replaced, dst)
    assert ex.binding is not binding
    assert torch.equal(dst["w"], replaced["w"].to(torch.bfloat16))
    ex.close()
    ex.close()  # idempotent
    with pytest.raises(PlanError, match="after close"):
        ex.run(src, dst)


def test_a_tensor_the_plan_needs_is_named_when_missing(group):
    _, plan = one_rank_plan()
    with pytest.raises(PlanError, match=r"rank 0: src tensor\(s\) \['w'\]"):
        make_executor(plan, group).prepare({}, {"w": torch.zeros(6, 4, dtype=torch.bfloat16)})


def test_the_factory_picks_by_plan_and_device_and_refuses_what_does_not_apply(group):
    index, plan = one_rank_plan()
    assert isinstance(make_executor(plan, group, transport="streamed"), StreamedExecutor)
    assert isinstance(make_executor(plan, group, device="cpu"), RoundsExecutor)  # gloo is not stream-ordered
    assert isinstance(make_executor(BroadcastPlan.build(index, 0), group), BroadcastExecutor)
    _, fan = one_rank_plan(fanout=True)
    assert fan.fanout and isinstance(make_executor(fan, group), FanoutExecutor)
    with pytest.raises(PlanError, match="transport must be one of"):
        make_executor(plan, group, transport="carrier-pigeon")
    with pytest.raises(PlanError, match=r"does not take \['staging_budget_bytes'\]"):
        make_executor(plan, group, transport="rounds", staging_budget_bytes=1 << 20)
    with pytest.raises(PlanError, match="needs nixl="):
        make_executor(plan, group, transport="nixl")


def test_verify_reports_one_checksum_per_bucket_on_both_ends(group):
    _, plan = one_rank_plan()
    src, dst = {"w": torch.randn(6, 4)}, {"w": torch.zeros(6, 4, dtype=torch.bfloat16)}
    with make_executor(plan, group) as ex:
        stats = ex.run(src, dst, verify=True)
    # one rank: everything is a local copy, no bucket crosses the wire
    assert stats.checksums_sent == {} and stats.checksums_received == {}
    assert torch.equal(dst["w"], src["w"].to(torch.bfloat16))
