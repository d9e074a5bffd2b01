"""Random kills of engine workers in the middle of rebuilds and transfers, for tests and figures.

Every cycle SIGKILLs engine workers at random moments, in one of these modes (``MODES``):

* ``rebuild``: one, 0-100 ms into a rebuild (the re-admission of the shard replaced in the
  previous cycle: its rendezvous, gloo's full-mesh connect, the plan);
* ``transfer``: one, into the transfer;
* ``recovery``: one into the transfer, a second into the rebuild of the recovery after it;
* ``retry``: one into the transfer, a second into the RETRIED transfer (the recovery repeats);
* ``third``: one into each of the first three transfers, in three shards (with four shards or
  more, so one is left to verify over).

Each ``sync_weights`` must either verify exact weights over the shards it reports, or raise
within the refit deadline plus the settle budget an error that names every worker killed
before its last phase began. The killed shards are then replaced by fresh processes, so the
next sync re-admits them. Workers are ``ProcessWorker``s (one spawned process each, real
SIGKILLs, real gloo), so a cycle costs about a second.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit.control import ReshardWeightSynchronizer
from refit.runtime.handles import ProcessWorker, _descendants
from refit.testing.launch import scaled
from refit.testing.synthetic import SyntheticEngine, SyntheticTrainer

__all__ = ["run_chaos"]

MODES = ("rebuild", "transfer", "recovery", "retry", "third")  # where the kills land (see the module's docstring)
# how often each mode is drawn: a kill inside a rendezvous (a rebuild, the rebuild of a recovery)
# is where a fleet is most fragile, so a third of the kills or more are aimed at one
MODE_WEIGHTS = {"rebuild": 3, "transfer": 1, "recovery": 3, "retry": 1, "third": 1}


@dataclass(frozen=True)
class _Kill:
    """Kill ``target`` (shard, worker) ``delay_s`` after the sync enters ``phase`` for the ``nth`` time."""

    phase: str
    nth: int
    delay_s: float
    target: tuple[int, int]


class _Killer:
    """Kills the targets of ``plan`` as the sync's phases are entered (its ``on_phase``), from timer threads."""

    def __init__(self, kill: Callable[[tuple[int, int]], None], plan: list[_Kill]):
        self.kill, self.plan = kill, list(plan)
        self.timers: list[threading.Timer] = []
        self.fired: list[tuple[int, int]] = []
        self.at: list[float] = []  # time.monotonic() of each kill
        self.phases: list[str] = []  # the phase the sync was in as each kill landed
        self.entered: dict[str, int] = {}  # phase -> how many times the sync entered it
        self.now = ""
        self.now_since = 0.0  # time.monotonic() the sync entered its latest phase

    def __call__(self, phase: str) -> None:
        self.now, self.now_since = phase, time.monotonic()
        self.entered[phase] = self.entered.get(phase, 0) + 1
        for item in [k for k in self.plan if (k.phase, k.nth) == (phase, self.entered[phase])]:
            self.plan.remove(item)
            t = threading.Timer(item.delay_s, self._fire, (item.target,))
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


def _new_figures(seed: int, bound_s: float, timeout_s: float) -> dict[str, Any]:
    return {"seed": seed, "kills": 0, "syncs": 0, "verified": 0, "raised": 0, "readmitted": 0,
            "kills_by_mode": dict.fromkeys(MODES, 0), "kills_by_phase": {}, "errors": [], "unnamed_errors": [],
            "wrong_weights": [], "slow_errors": [], "torn_reported_healthy": [], "partly_named_errors": [],
            "torn_named": 0, "max_error_s": 0.0,
            "by_mode": {m: {"cycles": 0, "kills": 0, "verified": 0, "raised": 0, "errors": {}, "recoveries": {},
                            "max_error_s": 0.0, "max_verified_s": 0.0} for m in MODES},
            "max_verified_s": 0.0, "bound_s": bound_s, "timeout_s": timeout_s, "cycles": 0}


class _Chaos:
    """One chaos run: the fleet, the synchronizer, the schedule and the figures (``run_chaos``)."""

    def __init__(self, seed: int, sizes, trainers: int, refit_timeout_s: float, grace_s: float,
                 ping_timeout_s: float, hidden: int, transfer_delay_s: float, say: Callable[[str], None]):
        self.rng, self.sizes, self.hidden, self.transfer_delay_s, self.say = (
            random.Random(seed), tuple(sizes), hidden, transfer_delay_s, say)
        self.ts = [ProcessWorker(SyntheticTrainer, r, trainers, hidden=hidden, name=f"trainer {r}",
                                 start_timeout_s=scaled(120.0)) for r in range(trainers)]
        self.es = [[self.engine(s, w) for w in range(n)] for s, n in enumerate(self.sizes)]
        self.retired: list[ProcessWorker] = []
        self.spawner = cf.ThreadPoolExecutor(2, thread_name_prefix="chaos-spawn")
        self.sync = ReshardWeightSynchronizer(self.ts, self.es, refit_timeout_s=refit_timeout_s, grace_s=grace_s,
                                              ping_timeout_s=ping_timeout_s)
        self.bound_s = refit_timeout_s + self.sync.settle_budget_s()
        self.fig = _new_figures(seed, self.bound_s, refit_timeout_s)
        self.step = 0
        self.held: dict[tuple[int, int], tuple[Any, int]] = {}  # (shard, worker) -> (its handle, step it holds whole)
        self.pending_heal: dict[int, Any] = {}

    def engine(self, s: int, w: int) -> ProcessWorker:
        return ProcessWorker(SyntheticEngine, s, w, self.sizes[s], hidden=self.hidden,
                             transfer_delay_s=self.transfer_delay_s, name=f"shard {s} worker {w}",
                             start_timeout_s=scaled(120.0))

    def next_step(self) -> None:
        self.step += 1
        for f in [t.call("set_step", self.step) for t in self.ts]:
            f.result(60)

    def check(self, shards) -> dict:
        calls = {(s, w): self.es[s][w].call("check_weights", self.step) for s in shards
                 for w in range(self.sizes[s])
                 if not self.es[s][w].is_dead()}  # one killed after its sync verified it has nothing to show
        return {k: bad for k, f in calls.items() if (bad := f.result(60))}

    def audit_torn(self) -> None:
        """Every live engine worker that says its weights are consistent holds one step whole.

        Run after every sync, verified or not: a torn engine reported healthy is the failure
        this guards against. A worker counts once it held a verified step (a fresh process
        holds nothing yet).
        """
        asked = {}
        for s, ws in enumerate(self.es):
            for w, h in enumerate(ws):
                if not h.is_dead() and self.held.get((s, w), (None,))[0] is h:
                    asked[(s, w)] = (h.call("refit_weights_state"), h.call("check_weights", self.step),
                                     h.call("check_weights", self.held[(s, w)][1]))
        for (s, w), (state, now, before) in asked.items():
            try:
                consistent, new_bad, old_bad = state.result(10)["consistent"], now.result(10), before.result(10)
            except Exception:  # killed since: it serves nothing
                continue
            if not consistent:
                self.fig["torn_named"] += 1
            elif not new_bad:
                self.held[(s, w)] = (self.es[s][w], self.step)
            elif old_bad:
                self.fig["torn_reported_healthy"].append({"step": self.step, "worker": f"shard {s} worker {w}",
                                                          "wrong": new_bad[:4]})

    def kill(self, target: tuple[int, int]) -> None:
        s, w = target
        self.es[s][w].kill()

    def heal(self) -> list[int]:
        """Hand in the shards killed last cycle: the next sync re-admits them (a rebuild)."""
        healed = sorted(self.pending_heal)
        for s, fut in self.pending_heal.items():
            self.retired.extend(self.es[s])
            self.es[s] = fut.result()
            self.sync.replace_shard(s, self.es[s])
        self.pending_heal = {}
        return healed

    def schedule(self, healed: list[int]) -> tuple[str, list[_Kill]]:
        """This cycle's mode and kills, drawn from the seed."""
        rng = self.rng
        modes = [m for m in MODES if (m != "rebuild" or healed)  # a rebuild needs a re-admission
                 and (m != "third" or len(self.sizes) >= 4)]  # one shard left after three kills
        mode = rng.choices(modes, weights=[MODE_WEIGHTS[m] for m in modes])[0]
        workers = [(s, w) for s, n in enumerate(self.sizes) for w in range(n)]
        targets = [rng.choice(workers)]
        for _ in range({"recovery": 1, "retry": 1, "third": 2}.get(mode, 0)):  # each in a shard not yet hit
            targets.append(rng.choice([t for t in workers if t[0] not in {u[0] for u in targets}]))
        in_transfer = rng.uniform(0.0, self.transfer_delay_s + 0.05)
        if mode == "rebuild":
            # within the first 100 ms: a re-admission on an idle machine is over in a few hundred
            return mode, [_Kill("build", 1, rng.uniform(0.0, 0.1), targets[0])]
        if mode == "recovery":
            return mode, [_Kill("transfer", 1, in_transfer, targets[0]),
                          _Kill("recover", 1, rng.uniform(0.0, 0.2), targets[1])]
        # the n-th kill inside the n-th transfer: the first, then the retried ones
        return mode, [_Kill("transfer", n, in_transfer if n == 1 else rng.uniform(0.0, self.transfer_delay_s + 0.05),
                            t) for n, t in enumerate(targets, start=1)]

    def cycle(self) -> None:
        """One sync with kills in it, judged: verified exact weights, or a bounded error naming the killed."""
        healed = self.heal()
        mode, plan = self.schedule(healed)
        # the replacements start now, beside the sync, so a cycle does not wait for a spawn
        spawned = {s: self.spawner.submit(lambda s=s: [self.engine(s, w) for w in range(self.sizes[s])])
                   for s in sorted({k.target[0] for k in plan})}
        killer = _Killer(self.kill, plan)
        self.sync.on_phase = killer
        self.next_step()
        t0 = time.monotonic()
        res = error = None
        try:
            res = self.sync.sync_weights()
        except Exception as e:  # every error is judged below: named and bounded
            error = e
        finally:
            self.sync.on_phase = None  # a kill planned for a round this sync never reached must not hit the next
        ended = time.monotonic()
        killer.join()
        fig, per = self.fig, self.fig["by_mode"][mode]
        fig["syncs"] += 1
        per["cycles"] += 1
        if res is not None:
            outcome = self.judge_verified(res, killer, per, healed, t0, ended)
        else:
            outcome = self.judge_raised(error, killer, per, ended - t0)
        for phase, at in zip(killer.phases, killer.at):
            phase = phase if at < ended else "after the sync"
            fig["kills_by_phase"][phase] = fig["kills_by_phase"].get(phase, 0) + 1
        fig["kills"] += len(killer.fired)
        fig["kills_by_mode"][mode] += len(killer.fired)
        per["kills"] += len(killer.fired)
        self.audit_torn()
        self.say(f"cycle: {mode} kill(s) {killer.fired} -> {outcome}")
        for s, fut in spawned.items():
            if any(t[0] == s for t in killer.fired):
                self.pending_heal[s] = fut
            else:  # the kill never fired (the sync ended first): the spare is not needed
                for h in fut.result():
                    h.close()
        for h in [h for h in self.retired if not h.is_dead()]:
            h.close()

    def judge_verified(self, res, killer: _Killer, per: dict, healed: list[int], t0: float, ended: float) -> str:
        fig, elapsed = self.fig, ended - t0
        bad = self.check(res.shards)
        # a kill that landed before the last commit round ended is one the sync had to see
        commit_end = max((t0 + e.at_s + e.duration_s for e in res.events if e.kind == "commit"), default=ended)
        killed_in = {s for (s, _), at in zip(killer.fired, killer.at) if at < commit_end}
        if not res.verified or bad or killed_in & set(res.shards):
            fig["wrong_weights"].append({"step": self.step, "bad": str(bad), "shards": res.shards,
                                         "killed": killer.fired})
        else:
            fig["verified"] += 1
            per["verified"] += 1
            per["recoveries"][res.recoveries] = per["recoveries"].get(res.recoveries, 0) + 1
            fig["readmitted"] += len([s for s in healed if s in res.shards])
            self.held.update({(s, w): (self.es[s][w], self.step) for s in res.shards for w in range(self.sizes[s])})
        fig["max_verified_s"] = max(fig["max_verified_s"], elapsed)
        per["max_verified_s"] = round(max(per["max_verified_s"], elapsed), 3)
        return f"verified over {res.shards} after {res.recoveries} recover(ies) in {elapsed:.2f}s"

    def judge_raised(self, error: BaseException, killer: _Killer, per: dict, elapsed: float) -> str:
        fig = self.fig
        fig["raised"] += 1
        per["raised"] += 1
        kind = type(error).__name__
        per["errors"][kind] = per["errors"].get(kind, 0) + 1
        text = f"{kind}: {error}"
        fig["errors"].append(text[:300])
        fig["max_error_s"] = max(fig["max_error_s"], elapsed)
        per["max_error_s"] = round(max(per["max_error_s"], elapsed), 3)
        labels = [f"shard {s} worker {w}" for s, w in killer.fired]
        if not any(label in text for label in labels):
            fig["unnamed_errors"].append(text[:500])
        # every kill before the sync's last phase began had a round or a probe to find it
        seen = [label for label, at in zip(labels, killer.at) if at < killer.now_since]
        missing = [label for label in seen if label not in text or label not in (getattr(error, "died", None) or [])]
        if missing:
            fig["partly_named_errors"].append({"missing": missing, "error": text[:500]})
        if elapsed > self.bound_s:
            fig["slow_errors"].append(round(elapsed, 2))
        return f"raised in {elapsed:.2f}s: {text[:200]}"

    def run(self, kills: int) -> dict:
        fig = self.fig
        try:
            self.sync.init_communicator()
            self.next_step()
            self.sync.sync_weights()
            self.held.update({(s, w): (h, self.step) for s, ws in enumerate(self.es) for w, h in enumerate(ws)})
            watched = list(self.ts)  # never killed: what they hold after the cycles is what the cycles left
            baseline = _resources(watched)
            processes_before = len(_descendants(os.getpid()))
            # Past ``kills``, cycles go on until one verified a re-admission: a short run whose every
            # cycle drew a second kill inside the recovery would otherwise show only raised syncs.
            while (fig["kills"] < kills or not fig["readmitted"]) and fig["cycles"] < 4 * kills + 4:
                fig["cycles"] += 1
                self.cycle()
            self.heal()
            self.next_step()
            res = self.sync.sync_weights()
            wrong = self.check(res.shards)
            fig["final_verified"] = bool(res.verified and res.shards == list(range(len(self.sizes))) and not wrong)
            fig["final"] = {"shards": res.shards, "verified": res.verified, "failure": res.failure, "wrong": str(wrong)}
            self.finish(_resources(watched), baseline, processes_before)
            return fig
        finally:
            self.sync.shutdown()
            self.spawner.shutdown(wait=True)
            for h in [*self.ts, *(h for s in self.es for h in s), *self.retired]:
                h.close()

    def finish(self, after: list[dict], baseline: list[dict], processes_before: int) -> None:
        fig = self.fig
        fig["fds_growth"] = max(a["fds"] - b["fds"] for a, b in zip(after, baseline))
        fig["threads_growth"] = max(a["threads"] - b["threads"] for a, b in zip(after, baseline))
        fig["listening_ports_after"] = max(len(a["listening_ports"]) for a in after)
        fig["listening_ports_before"] = max(len(b["listening_ports"]) for b in baseline)
        for h in self.retired:
            h.close()
        fig["processes_before"] = processes_before
        fig["processes_after"] = len(_descendants(os.getpid()))
        in_rendezvous = sum(n for phase, n in fig["kills_by_phase"].items() if phase in ("build", "recover"))
        fig["rendezvous_kill_share"] = round(in_rendezvous / max(fig["kills"], 1), 3)
        fig["max_error_s"] = round(fig["max_error_s"], 3)
        fig["max_verified_s"] = round(fig["max_verified_s"], 3)


def run_chaos(kills: int = 12, *, seed: int | None = None, sizes=(2, 1, 1, 1), trainers: int = 2,
              refit_timeout_s: float = 4.0, grace_s: float = 2.0, ping_timeout_s: float = 2.0,
              hidden: int = 32, transfer_delay_s: float = 0.1, log: Callable[[str], None] | None = None) -> dict:
    """Run cycles until ``kills`` workers were killed and a sync re-admitted a replaced shard
    (at most ``4 * kills + 4`` cycles); return the figures (see the keys).

    ``seed`` makes the schedule (which mode, which workers, which moments) reproducible;
    where each kill lands still depends on the machine. The figures count what happened,
    overall and per mode (``by_mode``); the caller decides what to assert.
    """
    seed = random.randrange(1 << 30) if seed is None else seed
    say = log or (lambda s: None)
    say(f"chaos seed {seed}")
    return _Chaos(seed, sizes, trainers, refit_timeout_s, grace_s, ping_timeout_s, hidden, transfer_delay_s,
                  say).run(kills)


if __name__ == "__main__":  # pragma: no cover - the figures' command line: python -m refit.testing.chaos KILLS [SEED]
    import json
    import sys

    out = run_chaos(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
                    seed=int(sys.argv[2]) if len(sys.argv) > 2 else None, log=lambda s: print(s, flush=True))
    print(json.dumps(out, indent=1))
