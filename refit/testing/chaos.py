"""Random kills of engine workers in the middle of rebuilds and transfers, for tests and figures.

Every cycle SIGKILLs one engine worker (sometimes a second one during the recovery that
follows) at a random moment: 0-200 ms into a rebuild (the re-admission of the shard
replaced in the previous cycle: its rendezvous, gloo's full-mesh connect, the plan), or
into a transfer. Each ``sync_weights`` must either verify exact weights over the shards it
reports, or raise within the refit deadline plus the settle budget an error that names a
killed worker. The killed shards are then replaced by fresh processes, so the next sync
re-admits them. Workers are ``ProcessWorker``s (one spawned process each, real SIGKILLs,
real gloo), so a cycle costs about a second.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from refit.control import ReshardWeightSynchronizer
from refit.runtime.handles import ProcessWorker, _descendants
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

__all__ = ["run_chaos"]

MODES = ("rebuild", "transfer", "recovery")  # where the kill lands; "recovery": a 2nd kill in the rebuild after a 1st


class _Killer:
    """Kills ``targets`` ``delay_s`` after the sync enters ``phase`` (once), from a timer thread."""

    def __init__(self, kill: Callable[[tuple[int, int]], None], plan: list[tuple[str, float, tuple[int, int]]]):
        self.kill, self.plan = kill, list(plan)
        self.timers: list[threading.Timer] = []
        self.fired: list[tuple[int, int]] = []
        self.at: list[float] = []  # time.monotonic() of each kill
        self.phases: list[str] = []  # the phase the sync was in as each kill landed
        self.now = ""

    def __call__(self, phase: str) -> None:
        self.now = phase
        for item in [p for p in self.plan if p[0] == phase]:
            self.plan.remove(item)
            _, delay, target = item
            t = threading.Timer(delay, self._fire, (target,))
            self.timers.append(t)
            t.start()

    def _fire(self, target: tuple[int, int]) -> None:
        self.kill(target)
        self.at.append(time.monotonic())
        self.fired.append(target)
        self.phases.append(self.now)

    def join(self) -> None:
        for t in self.timers:
            t.join(30)


def _resources(handles) -> list[dict]:
    return [h.call("refit_resources").result(60) for h in handles]


def run_chaos(kills: int = 12, *, seed: int | None = None, sizes=(2, 1, 1), trainers: int = 2,
              refit_timeout_s: float = 4.0, grace_s: float = 2.0, ping_timeout_s: float = 2.0,
              hidden: int = 32, transfer_delay_s: float = 0.1, log: Callable[[str], None] | None = None) -> dict:
    """Run cycles until ``kills`` workers were killed and a sync re-admitted a replaced shard
    (at most ``4 * kills + 4`` cycles); return the figures (see the keys).

    ``seed`` makes the schedule (which worker, which moment) reproducible; where each kill
    lands still depends on the machine. The figures count what happened; the caller
    decides what to assert.
    """
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    say = log or (lambda s: None)
    say(f"chaos seed {seed}")

    def engine(s: int, w: int) -> ProcessWorker:
        return ProcessWorker(SyntheticEngine, s, w, sizes[s], hidden=hidden, transfer_delay_s=transfer_delay_s,
                             name=f"shard {s} worker {w}")

    ts = [ProcessWorker(SyntheticTrainer, r, trainers, hidden=hidden, name=f"trainer {r}") for r in range(trainers)]
    es = [[engine(s, w) for w in range(n)] for s, n in enumerate(sizes)]
    retired: list[ProcessWorker] = []
    spawner = cf.ThreadPoolExecutor(2, thread_name_prefix="chaos-spawn")
    sync = ReshardWeightSynchronizer(ts, es, refit_timeout_s=refit_timeout_s, grace_s=grace_s,
                                     ping_timeout_s=ping_timeout_s)
    bound_s = refit_timeout_s + sync.settle_budget_s()
    fig: dict[str, Any] = {"seed": seed, "kills": 0, "syncs": 0, "verified": 0, "raised": 0, "readmitted": 0,
                           "kills_by_mode": dict.fromkeys(MODES, 0), "kills_by_phase": {}, "errors": [],
                           "unnamed_errors": [], "wrong_weights": [], "slow_errors": [], "torn_reported_healthy": [],
                           "torn_named": 0, "max_error_s": 0.0,
                           "max_verified_s": 0.0, "bound_s": bound_s, "timeout_s": refit_timeout_s, "cycles": 0}
    step = 0

    def set_step(n: int) -> None:
        for f in [t.call("set_step", n) for t in ts]:
            f.result(60)

    def check(shards) -> dict:
        calls = {(s, w): es[s][w].call("check_weights", step) for s in shards for w in range(sizes[s])
                 if not es[s][w].is_dead()}  # one killed after its sync verified it has nothing to show
        return {k: bad for k, f in calls.items() if (bad := f.result(60))}

    held: dict[tuple[int, int], tuple[Any, int]] = {}  # (shard, worker) -> (its handle, the step it holds whole)

    def audit_torn() -> None:
        """Every live engine worker that says its weights are consistent holds one step whole.

        Run after every sync, verified or not: a torn engine reported healthy is the failure
        this guards against. A worker counts once it held a verified step (a fresh process
        holds nothing yet).
        """
        asked = {}
        for s, ws in enumerate(es):
            for w, h in enumerate(ws):
                if not h.is_dead() and held.get((s, w), (None,))[0] is h:
                    asked[(s, w)] = (h.call("refit_weights_state"), h.call("check_weights", step),
                                     h.call("check_weights", held[(s, w)][1]))
        for (s, w), (state, now, before) in asked.items():
            try:
                consistent, new_bad, old_bad = state.result(10)["consistent"], now.result(10), before.result(10)
            except Exception:  # noqa: BLE001 - killed since: it serves nothing
                continue
            if not consistent:
                fig["torn_named"] += 1
            elif not new_bad:
                held[(s, w)] = (es[s][w], step)
            elif old_bad:
                fig["torn_reported_healthy"].append({"step": step, "worker": f"shard {s} worker {w}",
                                                     "wrong": new_bad[:4]})

    def kill(target: tuple[int, int]) -> None:
        s, w = target
        es[s][w].kill()

    try:
        sync.init_communicator()
        step += 1
        set_step(step)
        sync.sync_weights()
        held.update({(s, w): (h, step) for s, ws in enumerate(es) for w, h in enumerate(ws)})
        watched = list(ts)  # never killed: what they hold after the cycles is what the cycles left
        baseline = _resources(watched)
        processes_before = len(_descendants(os.getpid()))
        pending_heal: dict[int, Any] = {}
        cycles, max_cycles = 0, 4 * kills + 4
        # Past ``kills``, cycles go on until one verified a re-admission: a short run whose every
        # cycle drew a second kill inside the recovery would otherwise show only raised syncs.
        while (fig["kills"] < kills or not fig["readmitted"]) and cycles < max_cycles:
            cycles += 1
            # hand in the shards killed last cycle: this sync re-admits them (a rebuild)
            healed = sorted(pending_heal)
            for s, fut in pending_heal.items():
                retired.extend(es[s])
                es[s] = fut.result()
                sync.replace_shard(s, es[s])
            pending_heal = {}
            mode = rng.choice(MODES if healed else MODES[1:])  # no rebuild to kill in without a re-admission
            workers = [(s, w) for s, n in enumerate(sizes) for w in range(n)]
            first = rng.choice(workers)
            if mode == "rebuild":
                plan = [("build", rng.uniform(0.0, 0.2), first)]
            elif mode == "transfer":
                plan = [("transfer", rng.uniform(0.0, transfer_delay_s + 0.05), first)]
            else:
                second = rng.choice([t for t in workers if t[0] != first[0]])
                plan = [("transfer", rng.uniform(0.0, transfer_delay_s + 0.05), first),
                        ("recover", rng.uniform(0.0, 0.2), second)]
            # the replacements start now, beside the sync, so a cycle does not wait for a spawn
            spawned = {s: spawner.submit(lambda s=s: [engine(s, w) for w in range(sizes[s])])
                       for s in sorted({t[0] for _, _, t in plan})}

            killer = _Killer(kill, plan)
            sync.on_phase = killer
            step += 1
            set_step(step)
            t0 = time.monotonic()
            try:
                res = sync.sync_weights()
            except Exception as e:  # noqa: BLE001 - every error is judged below: named and bounded
                res, error = None, e
            ended = time.monotonic()
            elapsed = ended - t0
            killer.join()
            fig["syncs"] += 1
            if res is not None:
                bad = check(res.shards)
                killed_in = {s for (s, _), at in zip(killer.fired, killer.at) if at < ended}
                if not res.verified or bad or killed_in & set(res.shards):
                    fig["wrong_weights"].append({"step": step, "bad": str(bad), "shards": res.shards,
                                                 "killed": killer.fired})
                else:
                    fig["verified"] += 1
                    fig["readmitted"] += len([s for s in healed if s in res.shards])
                    held.update({(s, w): (es[s][w], step) for s in res.shards for w in range(sizes[s])})
                fig["max_verified_s"] = max(fig["max_verified_s"], elapsed)
                outcome = f"verified over {res.shards} in {elapsed:.2f}s"
            else:
                fig["raised"] += 1
                text = f"{type(error).__name__}: {error}"
                fig["errors"].append(text[:300])
                fig["max_error_s"] = max(fig["max_error_s"], elapsed)
                if not any(f"shard {s} worker {w}" in text for s, w in killer.fired):
                    fig["unnamed_errors"].append(text[:500])
                if elapsed > bound_s:
                    fig["slow_errors"].append(round(elapsed, 2))
                outcome = f"raised in {elapsed:.2f}s: {text[:200]}"
            for phase, at in zip(killer.phases, killer.at):
                phase = phase if at < ended else "after the sync"
                fig["kills_by_phase"][phase] = fig["kills_by_phase"].get(phase, 0) + 1
            fig["kills"] += len(killer.fired)
            fig["kills_by_mode"][mode] += len(killer.fired)
            audit_torn()
            fig["cycles"] = cycles
            say(f"cycle: {mode} kill(s) {killer.fired} -> {outcome}")
            for s, fut in spawned.items():
                if any(t[0] == s for t in killer.fired):
                    pending_heal[s] = fut
                else:  # the kill never fired (the sync ended first): the spare is not needed
                    for h in fut.result():
                        h.close()
            for h in [h for h in retired if not h.is_dead()]:
                h.close()
        for s, fut in pending_heal.items():
            retired.extend(es[s])
            es[s] = fut.result()
            sync.replace_shard(s, es[s])
        step += 1
        set_step(step)
        res = sync.sync_weights()
        fig["final_verified"] = bool(res.verified and res.shards == list(range(len(sizes)))
                                     and not check(res.shards))
        after = _resources(watched)
        fig["fds_growth"] = max(a["fds"] - b["fds"] for a, b in zip(after, baseline))
        fig["threads_growth"] = max(a["threads"] - b["threads"] for a, b in zip(after, baseline))
        fig["listening_ports_after"] = max(len(a["listening_ports"]) for a in after)
        fig["listening_ports_before"] = max(len(b["listening_ports"]) for b in baseline)
        for h in retired:
            h.close()
        fig["processes_before"] = processes_before
        fig["processes_after"] = len(_descendants(os.getpid()))
        fig["max_error_s"] = round(fig["max_error_s"], 3)
        fig["max_verified_s"] = round(fig["max_verified_s"], 3)
        return fig
    finally:
        sync.shutdown()
        spawner.shutdown(wait=True)
        for h in [*ts, *(h for s in es for h in s), *retired]:
            h.close()


if __name__ == "__main__":  # pragma: no cover - the figures' command line: python -m refit.testing.chaos KILLS [SEED]
    import json
    import sys

    out = run_chaos(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
                    seed=int(sys.argv[2]) if len(sys.argv) > 2 else None, log=lambda s: print(s, flush=True))
    print(json.dumps(out, indent=1))
