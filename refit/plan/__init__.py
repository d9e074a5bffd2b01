"""Pure planning: rosters, the merged parameter index and each rank's own transfer plan.

roster (entries, layouts, the merged index and its checks) < buckets (ops, packing)
< geometry < templates (one form's plan per rank position) < forms < rank_plan (and the plans cached per
rank, keyed so that a grown fleet never reuses a plan made for the old one).
"""

from refit.plan.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    Bucket,
    Op,
    contiguous,
    itemsize,
    pack_buckets,
    split_box,
    task_id,
    wire_dtype,
)
from refit.plan.geometry import LayoutGeometry
from refit.plan.rank_plan import (
    DEFAULT_STRIPE_BYTES,
    PlanCache,
    RankPlan,
    build_rank_plan,
    default_plan_cache,
    plan_key,
    reset_planner_cache,
)
from refit.plan.roster import (
    ParamIndex,
    ParamSpec,
    RosterEntry,
    RosterGroup,
    TensorLayout,
    check_local_shapes,
    group_roster,
    merge_rosters,
    min_bytes_needed,
    source_shards,
)
from refit.plan.split import split_plan
from refit.plan.templates import PlanStats

__all__ = [
    "DEFAULT_BUCKET_BYTES", "DEFAULT_DIRECT_BYTES", "DEFAULT_STRIPE_BYTES", "Bucket", "LayoutGeometry", "Op",
    "ParamIndex", "ParamSpec", "PlanCache", "PlanStats", "RankPlan", "RosterEntry", "RosterGroup", "TensorLayout",
    "build_rank_plan", "check_local_shapes", "contiguous", "default_plan_cache", "group_roster", "itemsize",
    "merge_rosters", "min_bytes_needed", "pack_buckets", "plan_key", "reset_planner_cache", "source_shards",
    "split_box", "split_plan", "task_id", "wire_dtype",
]
