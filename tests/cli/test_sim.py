"""The simulator and the bandwidth lower bound; ``refit plan`` end to end on small configs."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from helpers.layouts import rosters_for
from helpers.plans import WORLD, scenarios
from hypothesis import example, given, settings
from hypothesis import strategies as st

from refit import Replicate, Shard
from refit.cli import main
from refit.cli.sim import NCCL, NIXL, Topology, balance, connection_costs, lower_bound, simulate, traffic_of
from refit.plan import build_rank_plan, merge_rosters

# 8 ranks on two nodes; bandwidth alone (no per-message cost), to hold plans to the bandwidth bound
TOPO = Topology(gpus_per_node=4, nvlink_gbps=400.0, nic_gbps=50.0, latency_us=0.0, message_us=0.0)


def _traffic(index, topo=TOPO, **kw):
    return [traffic_of(build_rank_plan(index, r, **kw), topo) for r in range(index.world_size)]


def test_topology_nodes_and_links():
    t = Topology(gpus_per_node=8)
    assert [t.node(r) for r in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]
    t = Topology(gpus_per_node=8, nodes=(0, 0, 5, 5))
    assert t.node(2) == 5 and t.node(9) == 1  # ranks past the list fall back to rank // gpus
    assert t.bandwidth("nic_in") == 50e9 and t.bandwidth("nvl_out") == 450e9
    assert "400 Gb/s" in t.describe()


def test_simulated_time_of_a_broadcast_by_hand():
    """One 8 MB tensor from rank 0 (node 0) to four engines: rank 1 on node 0, 4..6 on node 1."""
    shape = (2048, 1024)  # float32: 8 MiB
    params = [("w", shape, ([0], [Replicate()], "float32"),
               [([1], [Replicate()], "float32"), ([4], [Replicate()], "float32"),
                ([5, 6], [Shard(0)], "float32")])]
    index = merge_rosters(rosters_for(params, 8), 8)
    topo = Topology(gpus_per_node=4, nvlink_gbps=400.0, nic_gbps=50.0, latency_us=10.0)
    traffic = _traffic(index, topo)
    nbytes = math.prod(shape) * 4
    t0 = traffic[0]
    assert t0.ports[0]["nvl_out"] == nbytes and t0.ports[0]["nic_out"] == 2 * nbytes
    assert traffic[4].ports[0]["nic_in"] == nbytes and traffic[5].ports[0]["nic_in"] == nbytes // 2
    sim = simulate(traffic, topo)
    # rank 0's NIC is the busiest port: 2 x 8 MiB at 50 GB/s, its four messages (one per peer)
    # at 15 us each, plus one round of direct buckets
    assert sim.seconds == pytest.approx(2 * nbytes / 50e9 + 4 * 15e-6 + 10e-6)
    assert t0.peers == 4 and traffic[5].peers == 1
    assert sim.phases[0].bottleneck_rank == 0 and sim.phases[0].bottleneck_port == "nic_out"
    bound = lower_bound(index, topo)
    assert bound.seconds == pytest.approx(2 * nbytes / 50e9)  # a single holder owes both NIC copies
    assert bound.owed_bytes == 3 * nbytes and bound.per_rank_in[5] == nbytes // 2
    # relaying: one copy crosses to node 1, and that node's four NICs can share it
    relay = lower_bound(index, topo, relay=True)
    assert relay.seconds == pytest.approx(nbytes / (4 * 50e9))
    assert relay.binding.startswith("node_ingress")


def test_messages_and_connections_cost_time():
    """Many small buckets cost their fixed overhead; every peer costs a connection."""
    shape = (64, 64)  # float32: 16 KiB, cut into 16 buckets of 1 KiB to one peer
    params = [("w", shape, ([0], [Replicate()], "float32"), [([4], [Replicate()], "float32")])]
    index = merge_rosters(rosters_for(params, 8), 8)
    topo = Topology(gpus_per_node=4, nvlink_gbps=400.0, nic_gbps=50.0, latency_us=0.0, message_us=20.0)
    traffic = [traffic_of(build_rank_plan(index, r, bucket_bytes=1024), topo) for r in range(8)]
    assert traffic[0].buckets[0] == 16 and traffic[0].peers == 1
    sim = simulate(traffic, topo)
    assert sim.seconds == pytest.approx(64 * 64 * 4 / 50e9 + 16 * 20e-6)
    assert sim.seconds > lower_bound(index, topo).seconds  # the bound stays bandwidth alone
    nccl, nixl = connection_costs([t.peers for t in traffic], NCCL), connection_costs([3, 1], NIXL)
    assert nccl["max_peers"] == 1 and nccl["setup_seconds"] == NCCL.setup_s and nccl["memory_bytes"] == 16 << 20
    assert nixl["setup_seconds"] == pytest.approx(3 * NIXL.setup_s) and nixl["memory_bytes"] == 0


def test_balance():
    assert balance([1, 1, 2]) == {"max": 2, "ideal": 4 / 3, "ratio": 1.5, "ranks": 3}
    assert balance([])["ratio"] == 1.0


# a scalar held on both nodes: the plan serves rank 1 its copy over the NIC from rank 4 while
# NVLink brings it the other tensor, so the bound must not charge both to NVLink
HELD_ON_BOTH_NODES = [("p0", (), (np.array([0, 4]), [Replicate()], "float32"),
                       [(np.arange(7), [Replicate()], "float32")]),
                      ("p1", (4, 6), (np.array([0]), [Replicate()], "float32"),
                       [(np.array([1]), [Replicate()], "float32")])]


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from([1 << 4, 1 << 20]))
@example(HELD_ON_BOTH_NODES, 1 << 4)
def test_bound_never_exceeds_any_plan(params, stripe_bytes):
    """The bound is a bound: no plan beats it, with or without fan-out; relaying only lowers it."""
    index = merge_rosters(rosters_for(params, WORLD), WORLD)
    plain = simulate(_traffic(index), TOPO)
    bound = lower_bound(index, TOPO)
    assert bound.seconds <= plain.seconds * (1 + 1e-9)
    fan = simulate(_traffic(index, fanout=True, fanout_stripe_bytes=stripe_bytes), TOPO)
    relay = lower_bound(index, TOPO, relay=True)
    assert relay.seconds <= fan.seconds * (1 + 1e-9)
    assert relay.seconds <= bound.seconds * (1 + 1e-9)
    assert relay.owed_bytes <= bound.owed_bytes


def test_point_to_point_plan_meets_its_bound_on_a_symmetric_layout():
    """4 source replicas, 4 engines of TP2 on the other node: every link is evenly used."""
    params = [(f"layer{i}.w", (512, 256), (np.arange(4), [Replicate()], "bfloat16"),
               [(np.array([4 + 2 * e % 4, 5 + 2 * e % 4]), [Shard(0)], "bfloat16") for e in range(2)])
              for i in range(8)]
    index = merge_rosters(rosters_for(params, 8), 8)
    sim = simulate(_traffic(index), TOPO)
    bound = lower_bound(index, TOPO)
    assert sim.seconds == pytest.approx(bound.seconds, rel=0.02)


# -- refit plan --------------------------------------------------------------------------------

SMALL = ["plan", "--model", "llama3-8b", "--layers", "4", "--train", "tp=2,pp=2", "--train-gpus", "8",
         "--engine", "tp=2", "--engine-gpus", "8", "--repeats", "1"]


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    flags = ("--json", "--png", "--rank", "--nic-gbps", "--nvlink-gbps", "--gpus-per-node", "--fanout", "--scaling")
    for flag in flags:
        assert flag in out


def test_cli_json_report(capsys):
    assert main(SMALL + ["--json", "--scaling", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 16 and report["index"]["params"] == 3 + 4 * 9
    assert report["plan_build"]["max_seconds"] > 0 and len(report["plan_build"]["samples"]) == 6
    by = {v["variant"]: v for v in report["variants"]}
    plain, fan = by["no fan-out"], by["fan-out (inside nodes)"]
    for v in by.values():
        assert v["consistent"] is True
        assert v["simulated"]["seconds"] >= v["lower_bound"]["seconds"]
        assert v["receivers"]["ratio"] <= 1.05
    assert plain["sim_over_bound"] <= 1.10
    # 4 engine replicas (8 ranks for the replicated norms) inside one node: one copy per group
    assert fan["bytes_from_sources"] == pytest.approx(plain["bytes_from_sources"] / 4, rel=1e-4)
    assert fan["bytes_from_sources"] <= plain["bytes_from_sources"] / 4
    assert fan["simulated"]["seconds"] < plain["simulated"]["seconds"]
    assert report["scaling"][0]["engine_ranks"] == 8
    # rosters as ranks report them (groups), merged as the controller does, then one rank's plan
    ix, rp = report["index"], report["rosters_to_plan"]
    assert ix["roster_format"] == "groups" and ix["distinct_names"] < ix["roster_names"]
    assert rp["seconds"] == pytest.approx(rp["merge_seconds"] + rp["plan_seconds"])
    for v in by.values():
        assert v["peers"]["trainer"]["max"] >= 1 and v["peers"]["generation"]["max"] >= 1
        nccl = v["rebuild"]["by_transport"]["nccl"]
        assert nccl["seconds"] == pytest.approx(v["rebuild"]["merge_seconds"] + v["rebuild"]["plan_seconds"]
                                                + nccl["connect_seconds"])
    assert plain["peers"]["generation"]["max"] <= fan["peers"]["generation"]["max"]


def test_a_delta_refit_sends_the_encoded_share_of_the_bytes(capsys):
    """At 3% of bf16 words changed, every bucket goes as indices plus values: 0.09 of its bytes."""
    assert main(SMALL + ["--json", "--delta", "0.03"]) == 0
    report = json.loads(capsys.readouterr().out)
    plain = next(v for v in report["variants"] if v["variant"] == "no fan-out")
    d = plain["delta"]
    assert d["changed"] == 0.03 and d["bytes_over_full"] == pytest.approx(0.09, rel=0.02)
    assert d["bytes_sent_total"] < plain["bytes_sent_total"]
    assert d["simulated"]["seconds"] < plain["simulated"]["seconds"] and d["over_full"] < 0.5


def test_receivers_traffic_from_their_senders_equals_their_own_plans(monkeypatch):
    """Above LARGE_WORLD a plain plan's receivers are not planned: their traffic comes from
    their senders' buckets, and equals what their own plans give."""
    from refit.cli import plan_report
    from refit.models import build_index, get_model, parse_engine, parse_train

    model = dataclasses.replace(get_model("qwen3-235b-a22b"), num_layers=3)
    index = build_index(model, parse_train("tp=2,pp=1,ep=4,etp=1", world=4), parse_engine("tp=2,ep=4", world=4))
    full = plan_report.plan_all(index, TOPO, True, bucket_bytes=1 << 20)
    monkeypatch.setattr(plan_report, "LARGE_WORLD", 0)
    mirrored = plan_report.plan_all(index, TOPO, True, bucket_bytes=1 << 20)
    assert mirrored["receivers_from_senders"] == 4 and mirrored["consistent"] is True
    for a, b in zip(full["traffic"], mirrored["traffic"]):
        assert (a.ports, a.rounds, a.buckets, a.peers) == (b.ports, b.rounds, b.buckets, b.peers)


def test_cli_one_rank_and_text(capsys):
    assert main(SMALL + ["--rank", "9"]) == 0
    out = capsys.readouterr().out
    assert "rank 9: plan built in" in out and "receives" in out
    assert main(SMALL + ["--fanout", "off"]) == 0
    out = capsys.readouterr().out
    assert "no fan-out" in out and "sim/bound" in out


def test_cli_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(SMALL + ["--png", str(path), "--fanout", "off,node"]) == 0
    assert path.stat().st_size > 10_000


def test_cli_fp8_report_says_how_each_sampled_trainer_rank_quantizes(capsys):
    """Llama-3-8B's TP2 shards hold whole 128 x 128 blocks: every FP8 param quantized at pack, no merge."""
    assert main(SMALL + ["--json", "--fanout", "off", "--engine-dtype", "fp8"]) == 0
    report = json.loads(capsys.readouterr().out)
    samples = report["quantization"]["samples"]
    assert samples and all(q["rank"] < report["train_ranks"] for q in samples)
    assert all(q["at_pack"] > 0 and q["merged_amax"] == 0 and q["merged_amax_bytes"] == 0 for q in samples)
    assert main(SMALL + ["--fanout", "off", "--engine-dtype", "fp8"]) == 0
    assert "quantizes" in capsys.readouterr().out
