"""Random kills of engine worker processes inside rebuilds and transfers (``refit.testing.chaos``).

CI runs a few cycles; ``REFIT_CHAOS_KILLS=200`` (and ``REFIT_CHAOS_SEED``) runs the figures'
run. Kills land in rebuilds, transfers, recoveries and retried transfers (two or three in one
sync). Every sync verifies exact weights or raises, within the refit deadline plus the settle
budget, an error naming every worker killed before its last phase; no live engine worker that reports its weights
consistent holds a mix of steps; killed shards are replaced and re-admitted; the
trainers hold no more fds, threads or listening ports at the end than after the first sync.
"""

import json
import os
import random

import pytest

from refit.testing.chaos import run_chaos

KILLS = int(os.environ.get("REFIT_CHAOS_KILLS", "4"))
SEED = int(os.environ.get("REFIT_CHAOS_SEED", random.randrange(1 << 30)))


@pytest.mark.timeout(120 + 30 * KILLS)
def test_random_kills_inside_rebuilds_and_transfers_verify_or_name_the_dead_in_bounded_time():
    print(f"REFIT_CHAOS_SEED={SEED}")
    fig = run_chaos(KILLS, seed=SEED, log=print)
    print(json.dumps(fig, indent=1))
    if os.environ.get("REFIT_CHAOS_JSON"):
        with open(os.environ["REFIT_CHAOS_JSON"], "w") as f:
            json.dump(fig, f, indent=1)
    assert fig["kills"] >= KILLS
    assert fig["unnamed_errors"] == [], fig["unnamed_errors"]
    assert fig["partly_named_errors"] == [], fig["partly_named_errors"]
    assert sum(m["cycles"] for m in fig["by_mode"].values()) == fig["cycles"], fig["by_mode"]
    assert sum(m["kills"] for m in fig["by_mode"].values()) == fig["kills"], fig["by_mode"]
    assert fig["wrong_weights"] == [], fig["wrong_weights"]
    assert fig["torn_reported_healthy"] == [], fig["torn_reported_healthy"]
    assert fig["slow_errors"] == [], (fig["slow_errors"], fig["bound_s"])
    assert fig["verified"] + fig["raised"] == fig["syncs"] and fig["verified"] > 0
    assert fig["readmitted"] > 0 and fig["final_verified"]
    assert fig["fds_growth"] <= 2 and fig["threads_growth"] <= 2, fig
    assert fig["listening_ports_after"] <= fig["listening_ports_before"], fig
    assert fig["processes_after"] <= fig["processes_before"], fig
