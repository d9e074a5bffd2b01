"""``refit plan``: plan a refit of a model between two layouts and report what it would cost.

Builds the merged index straight from the model's shapes and the layout strings, then the
plan of every rank (or of ``--rank R`` alone), and reports per-rank bytes sent and
received, the heaviest rank against the ideal, the time to build one rank's plan, and a
simulated refit time on the declared topology next to its bandwidth lower bound (see
``refit.cli.sim``), with and without replica fan-out. ``--png`` draws the per-rank load and
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
    choice_list,
    dtype,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_list,
    writable_file,
)

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
    g.add_argument("--train-gpus", type=positive_int, default=256,
                   help="training ranks; dp is derived when not given (256)")
    g.add_argument("--engine", default="tp=8,ep=128", help="engine layout: tp, dp, ep (default tp=8,ep=128)")
    g.add_argument("--engine-gpus", type=positive_int, default=128,
                   help="engine ranks; dp is derived when not given (128)")
    g.add_argument("--train-dtype", type=dtype, default=None, help="training weights dtype (default: the model's)")
    g.add_argument("--engine-dtype", type=dtype, default=None, help="engine weights dtype (default: the model's)")
    g.add_argument("--rosters", action="store_true",
                   help="build every rank's roster list and merge them with merge_rosters, as ranks do at run "
                        "time (slower), instead of building the merged index straight from the layouts")
    g = p.add_argument_group("plan")
    g.add_argument("--rank", type=non_negative_int, default=None, help="plan this rank alone (no simulation)")
    g.add_argument("--bucket-mb", type=positive_float, default=64.0, help="bucket size in MiB (64)")
    g.add_argument("--fanout", type=choice_list(FANOUT_VARIANTS, allow_empty=True),
                   default="off,replicas,node",
                   help="comma list of variants: off, replicas (groups of identical regions), node (groups kept "
                        "inside a node); default all three; '' for none (with --scaling)")
    g.add_argument("--stripe-mb", type=positive_float, default=4.0, help="fan-out stripe size in MiB (4)")
    g.add_argument("--repeats", type=positive_int, default=3, help="cold builds timed per sampled rank (3)")
    g.add_argument("--no-check", action="store_true", help="skip the cross-rank send/recv consistency check")
    g = p.add_argument_group("topology")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs that share NVLink (8)")
    g.add_argument("--nvlink-gbps", type=positive_float, default=450.0, help="NVLink GB/s per GPU, one direction (450)")
    g.add_argument("--nic-gbps", type=positive_float, default=50.0,
                   help="NIC GB/s per GPU between nodes (50 = 400 Gb/s)")
    g.add_argument("--latency-us", type=non_negative_float, default=20.0, help="latency per round of buckets (20 us)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    g.add_argument("--png", metavar="FILE", type=writable_file, default=None,
                   help="draw per-rank load and the simulated timeline")
    g.add_argument("--per-rank", action="store_true", help="include every rank's bytes in the JSON")
    g.add_argument("--scaling", type=positive_int_list, default=None, metavar="N,N,...",
                   help="also time one rank's plan for these engine rank counts (e.g. 64,128,256,512,1024)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _setup(args):
    import dataclasses

    from refit.cli.sim import Topology
    from refit.models import build_index, get_model, parse_engine, parse_train
    from refit.models.parallel import node_map

    model = get_model(args.model)
    if args.layers is not None:
        model = dataclasses.replace(model, num_layers=min(args.layers, model.num_layers),
                                    num_mtp_layers=0 if args.layers < model.num_layers else model.num_mtp_layers)
    train = parse_train(args.train, world=args.train_gpus)
    engine = parse_engine(args.engine, world=args.engine_gpus)
    t0 = time.perf_counter()
    merge = {}
    if args.rosters:
        from refit.models import build_rosters
        from refit.plan import merge_rosters

        rosters = build_rosters(model, train, engine, train_dtype=args.train_dtype, engine_dtype=args.engine_dtype)
        merge["roster_entries"] = sum(len(v) for v in rosters.values())
        merge["build_rosters_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = merge_rosters(rosters, train.world + engine.world)
        del rosters
    else:
        index = build_index(model, train, engine, train_dtype=args.train_dtype, engine_dtype=args.engine_dtype)
    t1 = time.perf_counter()
    _ = index.digest  # computed lazily: force it here so its cost is timed apart from the plans
    t2 = time.perf_counter()
    nodes = node_map(train.world, train.world, index.world_size, args.gpus_per_node)
    topo = Topology(args.gpus_per_node, args.nvlink_gbps, args.nic_gbps, args.latency_us, tuple(nodes))
    key = "merge_rosters_seconds" if args.rosters else "build_index_seconds"
    return model, train, engine, index, topo, {**merge, key: t1 - t0, "digest_seconds": t2 - t1}


def _plan_kwargs(args, variant: dict, topo) -> dict:
    kw = dict(bucket_bytes=int(args.bucket_mb * (1 << 20)))
    if variant.get("fanout"):
        kw.update(fanout=True, fanout_stripe_bytes=int(args.stripe_mb * (1 << 20)))
        if variant.get("node_domains"):
            kw["fanout_domains"] = topo.nodes
    return kw


def time_one_rank(index, rank: int, repeats: int, **kw) -> dict:
    """Cold builds of one rank's plan (the index's cached geometry dropped before each)."""
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
    out: dict[int, list[int]] = {}
    for b in buckets:
        d = out.setdefault(b.peer, [0, 0, 0])
        d[0] += len(b.ops)
        d[1] ^= sum(op.task_id for op in b.ops) & ((1 << 64) - 1)
        d[2] += b.nbytes
    return {p: tuple(v) for p, v in out.items()}


def plan_all(index, topo, check: bool, **kw) -> dict:
    """Every rank's plan, reduced to its traffic; cross-rank consistency checked on the way."""
    from refit.cli.sim import traffic_of
    from refit.plan import build_rank_plan

    traffic = []
    sends: dict[tuple[int, int, int], tuple] = {}
    recvs: dict[tuple[int, int, int], tuple] = {}
    t0 = time.perf_counter()
    for r in range(index.world_size):
        plan = build_rank_plan(index, r, **kw)
        traffic.append(traffic_of(plan, topo))
        if check:
            for phase, (s, rv) in enumerate(((plan.sends, plan.recvs), (plan.gather_sends, plan.gather_recvs))):
                for peer, d in _pair_digest(s).items():
                    sends[(phase, r, peer)] = d
                for peer, d in _pair_digest(rv).items():
                    recvs[(phase, peer, r)] = d
        del plan
    seconds = time.perf_counter() - t0
    consistent = None
    if check:
        consistent = sends == recvs
    return {"traffic": traffic, "seconds": seconds, "consistent": consistent}


def run_variant(name: str, variant: dict, args, index, topo, train_world: int) -> dict:
    from refit.cli.sim import balance, lower_bound, simulate

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
    out = {
        "variant": name,
        "fanout": bool(variant.get("fanout")),
        "node_domains": bool(variant.get("node_domains")),
        "plans_all_ranks_seconds": res["seconds"],
        "consistent": res["consistent"],
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
    variants = []
    for key in args.fanout:
        name, variant = FANOUT_VARIANTS[key]
        variants.append(run_variant(name, variant, args, index, topo, train.world))
    report["variants"] = variants
    if args.scaling:
        report["scaling"] = scaling(args, model, train, args.repeats)
    return report


def _print_text(report: dict) -> None:
    m = report["model"]
    print(f"{m['name']}: {m['params'] / 1e9:.1f}B params, {m['tensors']} tensors, {m['dtype']}")
    print(f"train {report['train']} ({report['train_ranks']} ranks) -> engine {report['engine']} "
          f"({report['engine_ranks']} ranks); {report['topology']}")
    ix = report["index"]
    if "merge_rosters_seconds" in ix:
        print(f"index: {ix['roster_entries']} roster entries merged into {ix['params']} params in "
              f"{ix['merge_rosters_seconds']:.2f} s, digest {ix['digest_seconds']:.2f} s")
    else:
        print(f"index: {ix['params']} params built in {ix['build_index_seconds']:.2f} s, "
              f"digest {ix['digest_seconds']:.2f} s")
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
        ph = "; ".join(f"{p['name']} {p['seconds'] * 1e3:.0f} ms (rank {p['bottleneck_rank']} {p['bottleneck_port']})"
                       for p in v["simulated"]["phases"])
        print(f"  {v['variant']}: {ph}; bound: {v['lower_bound']['binding']}")
    for row in report.get("scaling", []):
        print(f"  scaling: {row['engine_ranks']:>5} engine ranks ({row['engine']}): one rank's plan "
              f"max {row['max_seconds'] * 1e3:.1f} ms wall, {row['max_cpu_seconds'] * 1e3:.1f} ms CPU "
              f"(rank {row['max_rank']}, {row['max_rank_ops']} ops, "
              f"{row['us_per_op_worst_rank']:.1f} us/op); index {row['index_seconds']:.2f} s")


def check_args(args) -> None:
    """Refuse what would fail or be ignored only after the plans are built (minutes on a large model)."""
    from refit.errors import ConfigError

    world = args.train_gpus + args.engine_gpus
    if args.rank is not None:
        if args.rank >= world:
            raise ConfigError(f"--rank {args.rank}: outside the {world} ranks (--train-gpus + --engine-gpus)")
        ignored = [flag for flag, given in (("--png", args.png), ("--scaling", args.scaling),
                                            ("--per-rank", args.per_rank)) if given]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} report every rank's plans; --rank {args.rank} plans one alone")
    if args.png and not args.fanout:
        raise ConfigError(f"--png {args.png} draws the --fanout variants; --fanout '' asks for none")
    if args.png:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # optional extra
            raise ConfigError(f"--png {args.png}: needs matplotlib (pip install 'refit[plot]')")


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
    else:
        _print_text(report)
    if any(v.get("consistent") is False for v in report.get("variants", [])):
        print("error: some send and receive plans disagree", file=sys.stderr)
        return 1
    return 0
