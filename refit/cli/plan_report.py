"""``refit plan``: plan a refit of a model between two layouts and report what it would cost.

Builds every rank's roster as ranks report it at run time (one group per layout), passes
them through the wire format and merges them as the controller and every rank do, then
builds the plan of every rank (or of ``--rank R`` alone). It reports the rosters-to-plan
time (the merge plus the slowest sampled rank's plan), per-rank bytes and peers, the
heaviest rank against the ideal and the layout's bound, a simulated refit time on the
declared topology next to its bandwidth lower bound (see ``refit.cli.sim``), with and
without replica fan-out, and a simulated rebuild (merge, plan, connection set-up). ``--png`` draws the per-rank load and
the simulated timeline; ``--scaling`` measures how one rank's plan-build time grows with
the number of engine ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from refit.cli.checks import (
    MAX_PLANNED_RANKS,
    choice_list,
    dtype,
    engine_dtype,
    non_negative_float,
    non_negative_int,
    planned_ranks,
    positive_float,
    positive_int,
    positive_int_list,
    unit_fraction,
    writable_file,
)

# Worlds larger than this get the plain variant alone unless --fanout asks for more (every
# rank's fan-out plan takes minutes there), and the receivers' traffic of a plain plan from
# their senders' buckets (both ends cut the same ones) with a sample of receivers built in full.
LARGE_WORLD = 512

FANOUT_VARIANTS = {
    "off": ("no fan-out", dict(fanout=False)),
    "replicas": ("fan-out (replica groups)", dict(fanout=True)),
    "node": ("fan-out (inside nodes)", dict(fanout=True, node_domains=True)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and layouts")
    g.add_argument("--model", default="kimi-k2",
                   help="llama3-8b, llama3-70b, qwen3-235b-a22b, deepseek-v3, kimi-k2, "
                        "or a config.json (default kimi-k2)")
    g.add_argument("--layers", type=positive_int, default=None,
                   help="keep only the first N decoder layers (quick looks)")
    g.add_argument("--train", default="tp=8,pp=8,ep=32,etp=1",
                   help="training layout: tp, pp, dp, cp, ep, etp (default tp=8,pp=8,ep=32,etp=1)")
    g.add_argument("--train-gpus", type=planned_ranks, default=256,
                   help="training ranks; dp is derived when not given (256)")
    g.add_argument("--engine", default="tp=8,ep=128", help="engine layout: tp, dp, ep (default tp=8,ep=128)")
    g.add_argument("--engine-gpus", type=planned_ranks, default=128,
                   help="engine ranks; dp is derived when not given (128)")
    g.add_argument("--train-dtype", type=dtype, default=None, help="training weights dtype (default: the model's)")
    g.add_argument("--engine-dtype", type=engine_dtype, default=None,
                   help="engine weights dtype (default: the model's); fp8: the linear weights in 128x128 "
                        "block-scaled float8_e4m3fn, quantized on the trainer before the wire, scales beside them")
    g.add_argument("--rosters", action="store_true",
                   help="ranks report one roster entry per param (the old format, slower to merge) instead of "
                        "one group per layout")
    g = p.add_argument_group("plan")
    g.add_argument("--rank", type=non_negative_int, default=None, help="plan this rank alone (no simulation)")
    g.add_argument("--bucket-mb", type=positive_float, default=64.0, help="bucket size in MiB (64)")
    g.add_argument("--fanout", type=choice_list(FANOUT_VARIANTS, allow_empty=True),
                   default=None,
                   help="comma list of variants: off, replicas (groups of identical regions), node (groups kept "
                        f"inside a node); default all three up to {LARGE_WORLD} ranks, off above; '' for none "
                        "(with --scaling)")
    g.add_argument("--stripe-mb", type=positive_float, default=4.0, help="fan-out stripe size in MiB (4)")
    g.add_argument("--delta", type=unit_fraction, default=None, metavar="FRACTION",
                   help="also simulate a delta refit in which this share of every bucket's words changed (each "
                        "bucket sent dense, as a bitmask or as indices, whichever is smallest), against the full one")
    g.add_argument("--repeats", type=positive_int, default=3, help="cold builds timed per sampled rank (3)")
    g.add_argument("--no-check", action="store_true", help="skip the cross-rank send/recv consistency check")
    g = p.add_argument_group("topology")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs that share NVLink (8)")
    g.add_argument("--nvlink-gbps", type=positive_float, default=450.0, help="NVLink GB/s per GPU, one direction (450)")
    g.add_argument("--nic-gbps", type=positive_float, default=50.0,
                   help="NIC GB/s per GPU between nodes (50 = 400 Gb/s)")
    g.add_argument("--latency-us", type=non_negative_float, default=20.0, help="latency per round of buckets (20 us)")
    g.add_argument("--message-us", type=non_negative_float, default=15.0,
                   help="fixed cost per message (bucket) on its rank (15 us)")
    g = p.add_argument_group("output")
    form = g.add_mutually_exclusive_group()  # one report on stdout: argparse refuses both, naming them
    form.add_argument("--json", action="store_true", help="print the report as JSON")
    form.add_argument("--markdown", action="store_true",
                      help="print the report's tables as markdown (what docs/scale.md shows)")
    g.add_argument("--png", metavar="FILE", type=writable_file, default=None,
                   help="draw per-rank load and the simulated timeline")
    g.add_argument("--per-rank", action="store_true", help="include every rank's bytes in the JSON (with --json)")
    g.add_argument("--scaling", type=positive_int_list, default=None, metavar="N,N,...",
                   help="also time one rank's plan for these engine rank counts (e.g. 64,128,256,512,1024)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _setup(args):
    import dataclasses

    from refit.cli.sim import Topology
    from refit.models import get_model, parse_engine, parse_train
    from refit.models.parallel import node_map

    model = get_model(args.model)
    if args.layers is not None:
        model = dataclasses.replace(model, num_layers=min(args.layers, model.num_layers),
                                    num_mtp_layers=0 if args.layers < model.num_layers else model.num_mtp_layers)
    train = parse_train(args.train, world=args.train_gpus)
    engine = parse_engine(args.engine, world=args.engine_gpus)
    index, merge = gathered_index(model, train, engine, args)
    nodes = node_map(train.world, train.world, index.world_size, args.gpus_per_node)
    topo = Topology(args.gpus_per_node, args.nvlink_gbps, args.nic_gbps, args.latency_us, tuple(nodes),
                    message_us=args.message_us)
    return model, train, engine, index, topo, merge


def as_gathered(rosters: dict, wire) -> tuple[dict, int, int]:
    """Every rank's groups as the merge gets them: decoded from the wire format, so names and
    meshes are fresh objects with nothing cached on them. The merge reads the names of the
    first group it meets with each digest and only the digest of the others, so ranks
    reporting one group share the decoded names of its first copy (decoding millions of
    names that nothing reads would only slow this report down)."""
    from refit.plan import RosterGroup

    fresh: dict[tuple[str, str], RosterGroup] = {}
    out = {}
    for r in sorted(rosters):
        mine = []
        for g in rosters[r]:
            first = fresh.get((g.role, g.digest))
            if first is None:
                mine.append(fresh.setdefault((g.role, g.digest), wire.unpack(wire.pack(g))))
            else:
                mesh, placements = wire.unpack(wire.pack([g.mesh, g.placements]))
                mine.append(RosterGroup(first.names, first.shapes, g.dtype, mesh, placements, g.role, g.digest))
        out[r] = mine
    return out, len(fresh), sum(len(g.names) for g in fresh.values())


def gathered_index(model, train, engine, args):
    """The merged index as the run-time path makes it: every rank's roster (groups, or one
    entry per param with ``--rosters``), through the wire format (as the controller gets
    them), then ``merge_rosters``, timed as the fastest of ``--repeats`` merges."""
    from refit.comm import wire
    from refit.models import build_roster_groups, build_rosters
    from refit.plan import merge_rosters

    kw = dict(train_dtype=args.train_dtype, engine_dtype=args.engine_dtype)
    t0 = time.perf_counter()
    rosters = (build_rosters if args.rosters else build_roster_groups)(model, train, engine, **kw)
    out: dict = {"roster_format": "entries" if args.rosters else "groups",
                 "roster_entries": sum(len(v) for v in rosters.values()),
                 "build_rosters_seconds": time.perf_counter() - t0}
    if not args.rosters:
        out["roster_names"] = sum(len(g.names) for v in rosters.values() for g in v)
        t0 = time.perf_counter()
        rosters, out["distinct_groups"], out["distinct_names"] = as_gathered(rosters, wire)
        out["wire_seconds"] = time.perf_counter() - t0
    walls, cpus = [], []
    index = None
    for _ in range(max(1, args.repeats)):
        index = None  # free the last one before the clock starts
        t0, c0 = time.perf_counter(), time.process_time()
        index = merge_rosters(rosters, train.world + engine.world)
        _ = index.digest  # part of the merge (plan keys need it)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out.update(merge_rosters_seconds=min(walls), merge_rosters_cpu_seconds=min(cpus))
    return index, out


def _plan_kwargs(args, variant: dict, topo) -> dict:
    kw = dict(bucket_bytes=int(args.bucket_mb * (1 << 20)))
    if variant.get("fanout"):
        kw.update(fanout=True, fanout_stripe_bytes=int(args.stripe_mb * (1 << 20)))
        if variant.get("node_domains"):
            kw["fanout_domains"] = topo.nodes
    return kw


def time_one_rank(index, rank: int, repeats: int, **kw) -> dict:
    """Cold builds of one rank's plan (the planning state kept for the index dropped before each)."""
    from refit.plan import PlanStats, build_rank_plan, reset_planner_cache

    times, cpu = [], []
    plan = stats = None
    for _ in range(max(1, repeats)):
        reset_planner_cache(index)
        plan = None  # free the last plan before the clock starts
        stats = PlanStats()
        t0, c0 = time.perf_counter(), time.process_time()
        plan = build_rank_plan(index, rank, stats=stats, **kw)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    nops = stats.ops
    return {"rank": rank, "seconds_min": min(times), "seconds_median": statistics.median(times),
            "cpu_seconds_min": min(cpu), "ops": nops,
            "templates": stats.templates, "templates_reused": stats.reused,
            "bytes_sent": plan.bytes_sent + plan.gather_bytes_sent,
            "bytes_received": plan.bytes_received + plan.gather_bytes_received}


def sample_ranks(train_world: int, world: int) -> list[int]:
    picks = {0, train_world // 2, train_world - 1, train_world, (train_world + world) // 2, world - 1}
    return sorted(r for r in picks if 0 <= r < world)


def _pair_digest(buckets) -> dict[int, tuple[int, int, int]]:
    """Per peer: ops, a digest of their task ids, bytes (what both ends of a pair must agree on)."""
    out: dict[int, list[int]] = {}
    for b in buckets:
        d = out.get(b.peer)
        if d is None:
            d = out[b.peer] = [0, 0, 0]
        ops = b.ops
        d[0] += len(ops)
        d[1] ^= (ops[0].task_id if len(ops) == 1 else sum(op.task_id for op in ops)) & ((1 << 64) - 1)
        d[2] += b.nbytes
    return {p: tuple(v) for p, v in out.items()}


def source_ranks(index) -> set[int]:
    """Ranks that hold some param as a source (the only ranks a plan without fan-out sends from)."""
    groups = getattr(index.specs, "groups", None)
    layouts = {id(g[0]): g[0] for g in groups} if groups is not None else {
        id(s.src): s.src for s in index.specs.values()}
    return {r for lay in layouts.values() for r in lay.mesh_ranks}


def _plan_ranks(index, ranks, topo, check: bool, receivers, kw, wire) -> tuple:
    """Traffic, receivers' receipts and pair digests of the plans of ``ranks`` (``wire``: a bucket's
    bytes on the wire)."""
    from refit.cli.sim import Receipts, traffic_of
    from refit.plan import build_rank_plan

    traffic: dict[int, object] = {}
    receipts: dict[int, Receipts] = {}
    sends: dict[tuple[int, int, int], tuple] = {}
    recvs: dict[tuple[int, int, int], tuple] = {}
    for r in ranks:
        plan = build_rank_plan(index, r, **kw)
        traffic[r] = traffic_of(plan, topo, wire)
        if receivers:
            by_peer: dict[int, list] = {}
            for b in plan.sends:
                if b.peer in receivers:
                    got = by_peer.get(b.peer)
                    if got is None:
                        got = by_peer[b.peer] = []
                    got.append(b)
            for peer, buckets in by_peer.items():
                got = receipts.get(peer)
                if got is None:
                    got = receipts[peer] = Receipts(peer, topo)
                got.add(r, buckets, topo, wire)
        if check:
            for phase, (s, rv) in enumerate(((plan.sends, plan.recvs), (plan.gather_sends, plan.gather_recvs))):
                for peer, d in _pair_digest(s).items():
                    sends[(phase, r, peer)] = d
                for peer, d in _pair_digest(rv).items():
                    recvs[(phase, peer, r)] = d
        del plan
    return traffic, receipts, sends, recvs


def plan_all(index, topo, check: bool, delta: float | None = None, **kw) -> dict:
    """Every rank's traffic, cross-rank consistency checked on the way; with ``delta``, the bytes of
    a delta refit in which that share of every bucket's words changed.

    Every rank's plan is built, except for a plain plan (no fan-out) on more than
    ``LARGE_WORLD`` ranks: there the ranks that only receive get their traffic from their
    senders' buckets (``refit.cli.sim.Receipts``), and a sample of them is built in full and
    checked against what their senders send them."""
    from refit.cli.sim import Receipts, delta_wire_bytes

    wire = (lambda b: b.nbytes) if delta is None else delta_wire_bytes(delta)
    world = index.world_size
    senders = source_ranks(index)
    mirror = not kw.get("fanout") and world > LARGE_WORLD
    built = list(range(world)) if not mirror else sorted(senders)
    receivers = frozenset(r for r in range(world) if r not in senders) if mirror else frozenset()
    t0 = time.perf_counter()
    parts = [_plan_ranks(index, built, topo, check, receivers, kw, wire)]
    traffic: dict[int, object] = {}
    receipts: dict[int, Receipts] = {r: Receipts(r, topo) for r in receivers}
    sends: dict[tuple[int, int, int], tuple] = {}
    recvs: dict[tuple[int, int, int], tuple] = {}
    for tr, rc, se, rv in parts:
        traffic.update(tr)
        for r, got in rc.items():
            receipts[r].merge(got)
        sends.update(se)
        recvs.update(rv)
    checked = len(built)
    if mirror:
        for r, got in receipts.items():
            traffic[r] = got.traffic()
        if check:  # the receivers built in full: their receives must be what their senders send them
            step = max(1, len(receipts) // 16)
            sample = sorted(set(list(receipts)[::step]) | {max(receipts, default=0)}) if receipts else []
            _, _, _, rv = _plan_ranks(index, sample, topo, True, frozenset(), kw, wire)
            recvs.update(rv)
            sends = {k: v for k, v in sends.items() if k[2] in senders or k[2] in sample}
            checked += len(sample)
    seconds = time.perf_counter() - t0
    consistent = None
    if check:
        consistent = sends == recvs
    return {"traffic": [traffic[r] for r in range(world)], "seconds": seconds, "consistent": consistent,
            "plans_built": checked, "receivers_from_senders": len(receipts)}


def peer_counts(traffic, train_world: int) -> dict:
    """Distinct peers per rank, training and generation ranks apart."""
    out = {}
    for side, ranks in (("trainer", traffic[:train_world]), ("generation", traffic[train_world:])):
        peers = [t.peers for t in ranks]
        out[side] = {"max": max(peers, default=0), "mean": statistics.fmean(peers) if peers else 0.0}
    return out


def run_variant(name: str, variant: dict, args, index, topo, train_world: int) -> dict:
    from refit.cli.sim import CONNECTIONS, balance, connection_costs, lower_bound, simulate

    kw = _plan_kwargs(args, variant, topo)
    res = plan_all(index, topo, not args.no_check, **kw)
    traffic = res["traffic"]
    sim = simulate(traffic, topo)
    lb = lower_bound(index, topo, relay=bool(variant.get("fanout")))
    sent = [t.bytes_sent for t in traffic]
    recv = [t.bytes_received for t in traffic]
    src_ranks = [t for t in traffic if t.rank < train_world]
    dst_ranks = [t for t in traffic if t.rank >= train_world]
    senders = balance([t.ports[0]["nic_out"] + t.ports[0]["nvl_out"] for t in src_ranks])
    if lb.max_share_bytes:  # what the layouts allow: the heaviest replica set's share
        senders["layout_best"] = lb.max_share_bytes
        senders["ratio_to_layout_best"] = senders["max"] / lb.max_share_bytes
    receivers = balance([t.bytes_received for t in dst_ranks])
    need = max(lb.per_rank_in.values(), default=0)
    if need:
        receivers["layout_best"] = need
        receivers["ratio_to_layout_best"] = receivers["max"] / need
    if args.delta is not None:
        delta = plan_all(index, topo, False, delta=args.delta, **kw)["traffic"]
        dsim = simulate(delta, topo)
        full_bytes = sum(t.bytes_sent for t in traffic)
        delta_bytes = sum(t.bytes_sent for t in delta)
        delta_report = {"changed": args.delta, "bytes_sent_total": delta_bytes,
                        "bytes_over_full": delta_bytes / full_bytes if full_bytes else None,
                        "simulated": dsim.as_dict(), "over_full": dsim.seconds / sim.seconds if sim.seconds else None}
    out = {
        "variant": name,
        "fanout": bool(variant.get("fanout")),
        "node_domains": bool(variant.get("node_domains")),
        "plans_all_ranks_seconds": res["seconds"],
        "plans_built": res["plans_built"],
        "receivers_from_senders": res["receivers_from_senders"],
        "consistent": res["consistent"],
        "peers": peer_counts(traffic, train_world),
        "connections": [connection_costs([t.peers for t in traffic], c) for c in CONNECTIONS],
        "bytes_sent_total": sum(sent),
        "bytes_from_sources": sum(t.ports[0]["nic_out"] + t.ports[0]["nvl_out"] for t in src_ranks),
        "bytes_in_groups": sum(t.ports[1]["nic_out"] + t.ports[1]["nvl_out"] for t in traffic),
        "senders": senders,
        "receivers": receivers,
        "heaviest_rank": {"sent": max(range(len(sent)), key=sent.__getitem__),
                          "received": max(range(len(recv)), key=recv.__getitem__)},
        "simulated": sim.as_dict(),
        "lower_bound": lb.as_dict(),
        "sim_over_bound": sim.seconds / lb.seconds if lb.seconds else None,
        "delta": delta_report if args.delta is not None else None,
        "_sim": sim,
        "_traffic": traffic,
    }
    if args.per_rank:
        out["per_rank"] = {"bytes_sent": sent, "bytes_received": recv}
    return out


def scaling(args, model, train, repeats: int) -> list[dict]:
    """One rank's cold plan-build time as the engine grows (training layout fixed)."""
    from refit.models import build_index, parse_engine

    out = []
    for n in args.scaling:
        ep = _engine_ep(model, n, args)
        engine = parse_engine(f"tp={_engine_tp(args)}" + (f",ep={ep}" if ep else ""), world=n)
        t0 = time.perf_counter()
        index = build_index(model, train, engine, train_dtype=args.train_dtype, engine_dtype=args.engine_dtype)
        _ = index.digest  # computed lazily: force it so the index's full cost is in this timing
        merge = time.perf_counter() - t0
        rows = [time_one_rank(index, r, repeats, bucket_bytes=int(args.bucket_mb * (1 << 20)))
                for r in sample_ranks(train.world, index.world_size)]
        worst = max(rows, key=lambda x: x["cpu_seconds_min"])
        out.append({"engine_ranks": n, "engine": engine.describe(), "world": index.world_size,
                    "index_seconds": merge, "max_seconds": max(x["seconds_min"] for x in rows),
                    "max_cpu_seconds": worst["cpu_seconds_min"], "max_rank": worst["rank"],
                    "max_rank_ops": worst["ops"], "max_ops": max(x["ops"] for x in rows),
                    "us_per_op_worst_rank": 1e6 * worst["cpu_seconds_min"] / max(1, worst["ops"]),
                    "samples": rows})
    return out


def _engine_tp(args) -> int:
    from refit.models.parallel import _parse

    return _parse(args.engine, ("tp", "dp", "ep"), "engine").get("tp", 1)


def _engine_ep(model, n: int, args) -> int:
    """The largest EP size dividing both the experts and ``n`` (none for dense models)."""
    if not model.num_experts:
        return 0
    best = 0
    for ep in range(1, n + 1):
        if n % ep == 0 and model.num_experts % ep == 0:
            best = ep
    return best


def draw(path: str, report: dict, variants: list[dict], train_world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(variants)
    fig, axes = plt.subplots(n + 1, 1, figsize=(12, 3.2 * (n + 1)), constrained_layout=True)
    ax = axes[0]
    for v in variants:
        tr = v["_traffic"]
        ranks = [t.rank for t in tr]
        ax.plot(ranks, [t.bytes_sent / 1e9 for t in tr], lw=0.8, label=f"{v['variant']}: sent")
        ax.plot(ranks, [t.bytes_received / 1e9 for t in tr], lw=0.8, ls="--", label=f"{v['variant']}: received")
    ax.axvline(train_world - 0.5, color="grey", lw=0.5)
    ax.set_xlabel("rank (training | engine)")
    ax.set_ylabel("GB")
    ax.set_title(f"{report['model']['name']}: per-rank load, {report['train']} -> {report['engine']}")
    ax.legend(fontsize=7, ncol=3)
    colors = ["tab:blue", "tab:orange"]
    for ax, v in zip(axes[1:], variants):
        sim = v["_sim"]
        for rank, spans in sim.timeline.items():
            for phase, start, seconds in spans:
                ax.broken_barh([(start * 1e3, seconds * 1e3)], (rank - 0.4, 0.8), color=colors[phase], lw=0)
        lb = v["lower_bound"]["seconds"] * 1e3
        ax.axvline(lb, color="red", lw=1, label=f"lower bound {lb:.0f} ms")
        ax.axvline(sim.seconds * 1e3, color="black", lw=1, ls="--", label=f"simulated {sim.seconds * 1e3:.0f} ms")
        ax.set_title(f"{v['variant']}: simulated timeline (blue: from sources, orange: all-gather in groups)")
        ax.set_xlabel("ms")
        ax.set_ylabel("rank")
        ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_report(args) -> dict:
    model, train, engine, index, topo, merge = _setup(args)
    report: dict = {
        "model": model.summary(),
        "train": train.describe(), "train_ranks": train.world,
        "engine": engine.describe(), "engine_ranks": engine.world,
        "world": index.world_size,
        "topology": topo.describe(),
        "index": {**merge, "params": len(index.specs)},
    }
    kw = dict(bucket_bytes=int(args.bucket_mb * (1 << 20)))
    if args.rank is not None:
        report["plan_build"] = time_one_rank(index, args.rank, args.repeats, **kw)
        report["rosters_to_plan"] = rosters_to_plan(merge, report["plan_build"]["seconds_min"],
                                                    report["plan_build"]["cpu_seconds_min"])
        from refit.plan import build_rank_plan

        plan = build_rank_plan(index, args.rank, **kw)
        report["rank"] = {"rank": args.rank, "bytes_sent": plan.bytes_sent, "bytes_received": plan.bytes_received,
                          "local_bytes": plan.local_bytes, "peers": len(plan.peers()),
                          "send_buckets": len(plan.sends), "recv_buckets": len(plan.recvs),
                          "rounds": plan.num_rounds}
        return report
    samples = [time_one_rank(index, r, args.repeats, **kw) for r in sample_ranks(train.world, index.world_size)]
    worst = max(samples, key=lambda x: x["seconds_min"])
    report["plan_build"] = {"max_seconds": worst["seconds_min"], "max_rank": worst["rank"],
                            "max_cpu_seconds": max(x["cpu_seconds_min"] for x in samples), "samples": samples}
    report["rosters_to_plan"] = rosters_to_plan(merge, worst["seconds_min"], report["plan_build"]["max_cpu_seconds"])
    variants = []
    for key in variant_keys(args, index.world_size):
        name, variant = FANOUT_VARIANTS[key]
        v = run_variant(name, variant, args, index, topo, train.world)
        plan_cpu = report["plan_build"]["max_cpu_seconds"]
        if variant.get("fanout"):  # its plans cost more: the slowest sampled rank's, built cold once
            plan_cpu = max(time_one_rank(index, r, 1, **_plan_kwargs(args, variant, topo))["cpu_seconds_min"]
                           for r in sample_ranks(train.world, index.world_size))
        v["rebuild"] = rebuild(merge["merge_rosters_cpu_seconds"], plan_cpu, v["connections"])
        variants.append(v)
    report["variants"] = variants
    if args.engine_dtype == "fp8":
        report["quantization"] = quantization_summary(index, [r for r in sample_ranks(train.world, index.world_size)
                                                              if r < train.world])
    if args.scaling:
        report["scaling"] = scaling(args, model, train, args.repeats)
    return report


def quantization_summary(index, ranks: list[int]) -> dict:
    """Per sampled trainer rank: how many FP8 params it quantizes at pack from its own blocks,
    how many after merging partial amaxes (shards that cut blocks), and the amax bytes it merges."""
    from refit.plan.quant import MERGE_AMAX_THEN_QUANTIZE, QUANTIZE_AT_PACK, plan_quantization

    rows = []
    for r in ranks:
        names = [n for n in index.by_rank.get(r, ()) if index.specs[n].src.coords(r) is not None]
        plan = plan_quantization(index, r, names)
        ops = plan.ops if plan is not None else ()
        rows.append({"rank": r, "at_pack": sum(op.mode == QUANTIZE_AT_PACK for op in ops),
                     "merged_amax": sum(op.mode == MERGE_AMAX_THEN_QUANTIZE for op in ops),
                     "merged_amax_bytes": plan.merged_amax_bytes if plan is not None else 0})
    return {"samples": rows}


def variant_keys(args, world: int) -> list[str]:
    """The --fanout variants, or the default: all three up to ``LARGE_WORLD`` ranks, the plain one above."""
    if args.fanout is not None:
        return list(args.fanout)
    return list(FANOUT_VARIANTS) if world <= LARGE_WORLD else ["off"]


def rosters_to_plan(merge: dict, plan_seconds: float, plan_cpu_seconds: float) -> dict:
    """What a membership change costs a rank before it moves a byte: merging the gathered
    rosters, then its own plan (the slowest sampled rank's, built cold)."""
    return {"merge_seconds": merge["merge_rosters_seconds"], "merge_cpu_seconds": merge["merge_rosters_cpu_seconds"],
            "plan_seconds": plan_seconds, "plan_cpu_seconds": plan_cpu_seconds,
            "seconds": merge["merge_rosters_seconds"] + plan_seconds,
            "cpu_seconds": merge["merge_rosters_cpu_seconds"] + plan_cpu_seconds}


def rebuild(merge_cpu: float, plan_cpu: float, connections: list[dict]) -> dict:
    """A simulated rebuild per transport: the merge, the slowest rank's plan (CPU time on
    this machine), then its connections set up one after another (``refit.cli.sim.Connections``)."""
    return {"merge_seconds": merge_cpu, "plan_seconds": plan_cpu,
            "by_transport": {c["transport"]: {"connect_seconds": c["setup_seconds"],
                                              "seconds": merge_cpu + plan_cpu + c["setup_seconds"],
                                              "connection_memory_bytes": c["memory_bytes"]}
                             for c in connections}}


def _print_text(report: dict) -> None:
    m = report["model"]
    print(f"{m['name']}: {m['params'] / 1e9:.1f}B params, {m['tensors']} tensors, {m['dtype']}")
    print(f"train {report['train']} ({report['train_ranks']} ranks) -> engine {report['engine']} "
          f"({report['engine_ranks']} ranks); {report['topology']}")
    ix = report["index"]
    rp = report["rosters_to_plan"]
    print(f"index: {ix['roster_entries']} roster {ix['roster_format']} from {report['world']} ranks merged into "
          f"{ix['params']} params in {ix['merge_rosters_seconds']:.3f} s "
          f"({ix['merge_rosters_cpu_seconds']:.3f} s CPU); "
          f"rosters -> one rank's plan {rp['seconds']:.3f} s ({rp['cpu_seconds']:.3f} s CPU)")
    pb = report["plan_build"]
    if "rank" in report:
        r = report["rank"]
        print(f"rank {r['rank']}: plan built in {pb['seconds_min'] * 1e3:.1f} ms ({pb['ops']} ops); "
              f"sends {_gb(r['bytes_sent'])}, receives {_gb(r['bytes_received'])}, {r['peers']} peers, "
              f"{r['send_buckets']}+{r['recv_buckets']} buckets in {r['rounds']} rounds")
        return
    print(f"one rank's plan (cold): max {pb['max_seconds'] * 1e3:.1f} ms wall, {pb['max_cpu_seconds'] * 1e3:.1f} ms "
          f"CPU (rank {pb['max_rank']}); "
          + ", ".join(f"r{s['rank']} {s['seconds_min'] * 1e3:.0f} ms/{s['ops']} ops" for s in pb["samples"]))
    print()
    print(f"{'variant':<28}{'simulated':>11}{'bound':>10}{'sim/bound':>10}{'src bytes':>12}"
          f"{'max send/ideal':>16}{'max recv/ideal':>16}{'ok':>5}")
    for v in report["variants"]:
        print(f"{v['variant']:<28}{v['simulated']['seconds'] * 1e3:>9.0f}ms{v['lower_bound']['seconds'] * 1e3:>8.0f}ms"
              f"{v['sim_over_bound']:>10.3f}{v['bytes_from_sources'] / 1e12:>10.2f}TB"
              f"{v['senders']['ratio']:>16.3f}{v['receivers']['ratio']:>16.3f}{str(v['consistent']):>5}")
    for v in report["variants"]:
        pe = v["peers"]
        rb = "; ".join(f"{k} {x['seconds']:.2f} s" for k, x in v["rebuild"]["by_transport"].items())
        print(f"  {v['variant']}: peers per trainer rank max {pe['trainer']['max']} "
              f"(mean {pe['trainer']['mean']:.1f}), "
              f"per generation rank max {pe['generation']['max']} (mean {pe['generation']['mean']:.1f}); "
              f"busiest sender / layout bound {v['senders'].get('ratio_to_layout_best', 1.0):.4f}; rebuild {rb}")
    for v in report["variants"]:
        ph = "; ".join(f"{p['name']} {p['seconds'] * 1e3:.0f} ms (rank {p['bottleneck_rank']} {p['bottleneck_port']})"
                       for p in v["simulated"]["phases"])
        print(f"  {v['variant']}: {ph}; bound: {v['lower_bound']['binding']}")
    for v in report["variants"]:
        d = v.get("delta")
        if d:
            print(f"  {v['variant']}: delta refit, {d['changed']:.1%} of the words changed: "
                  f"{d['simulated']['seconds'] * 1e3:.0f} ms simulated ({d['over_full']:.3f} of the full refit), "
                  f"{d['bytes_sent_total'] / 1e12:.3f} TB sent ({d['bytes_over_full']:.3f} of the full bytes)")
    if "quantization" in report:
        print("  fp8: " + "; ".join(f"rank {q['rank']} quantizes {q['at_pack']} params at pack from its own blocks, "
                                     f"{q['merged_amax']} after merging amaxes ({q['merged_amax_bytes']} B)"
                                     for q in report["quantization"]["samples"]))
    for row in report.get("scaling", []):
        print(f"  scaling: {row['engine_ranks']:>5} engine ranks ({row['engine']}): one rank's plan "
              f"max {row['max_seconds'] * 1e3:.1f} ms wall, {row['max_cpu_seconds'] * 1e3:.1f} ms CPU "
              f"(rank {row['max_rank']}, {row['max_rank_ops']} ops, "
              f"{row['us_per_op_worst_rank']:.1f} us/op); index {row['index_seconds']:.2f} s")


def check_args(args) -> None:
    """Refuse what would fail or be ignored only after the plans are built (minutes on a large model)."""
    from refit.errors import ConfigError

    world = args.train_gpus + args.engine_gpus
    if args.per_rank and not args.json:
        raise ConfigError("--per-rank adds every rank's bytes to the JSON report; give --json too")
    too_many = [n for n in args.scaling or () if n > MAX_PLANNED_RANKS]
    if too_many:
        raise ConfigError(f"--scaling {','.join(map(str, args.scaling))}: {too_many[0]} engine ranks is more than "
                          f"{MAX_PLANNED_RANKS}, the most refit plan simulates")
    if args.rank is not None:
        if args.rank >= world:
            raise ConfigError(f"--rank {args.rank}: outside the {world} ranks (--train-gpus + --engine-gpus)")
        ignored = [flag for flag, given in (("--png", args.png), ("--scaling", args.scaling),
                                            ("--per-rank", args.per_rank), ("--delta", args.delta is not None))
                   if given]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} report every rank's plans; --rank {args.rank} plans one alone")
    if args.png and args.fanout is not None and not args.fanout:
        raise ConfigError(f"--png {args.png} draws the --fanout variants; --fanout '' asks for none")
    if args.png:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # optional extra
            raise ConfigError(f"--png {args.png}: needs matplotlib (pip install 'refit[plot]')")


def markdown_figures(report: dict) -> str:
    """The report's plan figures as a markdown table: pure functions of the model, the
    layouts and the topology, so a test can hold docs/scale.md to them."""
    out = ["| plan | simulated refit | lower bound | sim / bound | trainers send | inside groups "
           "| busiest sender / layout's bound | busiest receiver / its need | peers per trainer rank (max, mean) "
           "| peers per generation rank (max, mean) | NCCL connections of the busiest rank |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for v in report["variants"]:
        se, re_, pe = v["senders"], v["receivers"], v["peers"]
        nccl = next(c for c in v["connections"] if c["transport"] == "nccl")
        out.append(
            f"| {v['variant']} | {v['simulated']['seconds'] * 1e3:.1f} ms | {v['lower_bound']['seconds'] * 1e3:.1f} ms "
            f"| {v['sim_over_bound']:.3f} | {v['bytes_from_sources'] / 1e12:.3f} TB "
            f"| {v['bytes_in_groups'] / 1e12:.3f} TB "
            f"| {se['max'] / 1e9:.3f} / {se.get('layout_best', se['max']) / 1e9:.3f} GB "
            f"= {se.get('ratio_to_layout_best', 1.0):.4f} "
            f"| {re_['max'] / 1e9:.3f} / {re_.get('layout_best', re_['max']) / 1e9:.3f} GB "
            f"| {pe['trainer']['max']}, {pe['trainer']['mean']:.1f} | {pe['generation']['max']}, "
            f"{pe['generation']['mean']:.1f} | {nccl['max_peers']} peers: {nccl['setup_seconds'] * 1e3:.0f} ms, "
            f"{nccl['memory_bytes'] / (1 << 20):.0f} MiB |")
    return "\n".join(out)


def markdown_times(report: dict) -> str:
    """The report's timings as a markdown table (CPU seconds on the machine that ran it)."""
    ix, rp = report["index"], report["rosters_to_plan"]
    out = ["| roster groups (names) from all ranks | distinct groups (names read) | merge | one rank's plan "
           "| rosters -> plan | rebuild, NCCL / NIXL (plain plan) |",
           "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    reb = report["variants"][0]["rebuild"]["by_transport"] if report.get("variants") else {}
    rb = " / ".join(f"{x['seconds']:.2f} s" for x in reb.values()) or "-"
    out.append(f"| {ix['roster_entries']:,} ({ix.get('roster_names', ix['roster_entries']):,}) "
               f"| {ix.get('distinct_groups', '-')} ({ix.get('distinct_names', '-'):,}) "
               f"| {rp['merge_cpu_seconds']:.3f} s | {rp['plan_cpu_seconds']:.3f} s | {rp['cpu_seconds']:.3f} s "
               f"| {rb} |")
    return "\n".join(out)


def run(args) -> int:
    check_args(args)
    report = build_report(args)
    if args.png and "variants" in report:
        draw(args.png, report, report["variants"], report["train_ranks"])
        report["png"] = args.png
    for v in report.get("variants", []):
        v.pop("_sim", None)
        v.pop("_traffic", None)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    elif args.markdown and "variants" in report:
        print(markdown_figures(report))
        print()
        print(markdown_times(report))
    else:
        _print_text(report)
    if any(v.get("consistent") is False for v in report.get("variants", [])):
        print("error: some send and receive plans disagree", file=sys.stderr)
        return 1
    return 0
