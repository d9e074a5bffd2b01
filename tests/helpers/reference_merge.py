"""The per-entry merge: the independent reference that ``merge_rosters`` (groups, read once per
distinct group, layouts cached by content) is held to, index for index. It builds each entry's
layout afresh, so it shares none of the grouped merge's keys or caches."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from refit.errors import PlanError
from refit.layout import validate_layout
from refit.plan import ParamIndex, ParamSpec, RosterEntry, TensorLayout


def reference_merge(rosters: Mapping[int, Iterable[RosterEntry]], world_size: int) -> ParamIndex:
    """Check the per-rank rosters against each other and merge them into one spec per param.

    Raises ``PlanError`` / ``LayoutError`` naming the param and the ranks for: a
    destination that no source holds, a shape mismatch, placements that do not fit the
    mesh, a mesh rank outside the group, a rank listed twice, a mesh rank that did not
    report the param, and a rank in two destination layouts of one param.
    """
    seen: dict[tuple[str, str], dict[TensorLayout, list[int]]] = defaultdict(dict)
    shapes: dict[str, dict[tuple[int, ...], list[int]]] = defaultdict(dict)
    valid: set[tuple] = set()  # (shape, layout) pairs already checked
    for rank in sorted(rosters):
        if not 0 <= rank < world_size:
            raise PlanError(f"roster from rank {rank}, outside the process group of world size {world_size}")
        for e in rosters[rank]:
            layout = TensorLayout.make(e.mesh, e.placements, e.dtype, param=e.name)
            if (e.global_shape, layout) not in valid:
                validate_layout(
                    e.global_shape, layout.mesh_shape, layout.placements,
                    param=f"{e.name} ({e.role} on rank {rank})", world_size=world_size, mesh_ranks=layout.mesh_ranks,
                )
                valid.add((e.global_shape, layout))
            if layout.coords(rank) is None:
                raise PlanError(
                    f"{e.name}: rank {rank} reported a {e.role} layout whose mesh {list(layout.mesh_ranks)} "
                    "does not contain it"
                )
            seen[(e.name, e.role)].setdefault(layout, []).append(rank)
            shapes[e.name].setdefault(tuple(e.global_shape), []).append(rank)
    for name, by_shape in shapes.items():
        if len(by_shape) > 1:
            parts = "; ".join(f"{list(s)} on ranks {r}" for s, r in by_shape.items())
            raise PlanError(f"{name}: global shape mismatch: {parts}")
    specs: dict[str, ParamSpec] = {}
    by_rank: dict[int, set[str]] = defaultdict(set)
    names = sorted({n for n, _ in seen})
    for name in names:
        shape = next(iter(shapes[name]))
        layouts = {}
        for role in ("src", "dst"):
            layouts[role] = seen.get((name, role), {})
            if role == "src" and len(layouts[role]) > 1:
                parts = "; ".join(f"{lay.describe()} on ranks {sorted(rs)}" for lay, rs in layouts[role].items())
                raise PlanError(f"{name}: source ranks disagree on the layout: {parts}")
            claimed: dict[int, TensorLayout] = {}
            for layout, reporters in layouts[role].items():
                missing = sorted(set(layout.mesh_ranks) - set(reporters))
                if missing:
                    raise PlanError(
                        f"{name}: {role} ranks {missing} are in mesh {list(layout.mesh_ranks)} "
                        f"reported by ranks {sorted(reporters)} but did not report that layout"
                    )
                for r in layout.mesh_ranks:
                    if r in claimed:
                        raise PlanError(
                            f"{name}: rank {r} is in two {role} layouts ({claimed[r].describe()} and "
                            f"{layout.describe()}); a rank holds one local tensor per param and side"
                        )
                    claimed[r] = layout
        if not layouts["src"]:
            if layouts["dst"]:
                needers = sorted(r for lay in layouts["dst"] for r in lay.mesh_ranks)
                raise PlanError(f"{name}: destination ranks {needers} need this param but no source rank holds it")
            continue
        src = next(iter(layouts["src"]))
        dsts = tuple(sorted(layouts["dst"], key=lambda lay: (min(lay.mesh_ranks), lay.mesh_ranks)))
        specs[name] = ParamSpec(name, shape, src, dsts)
        for lay in (src, *dsts):
            for r in lay.mesh_ranks:
                by_rank[r].add(name)
    return ParamIndex(world_size, specs, {r: sorted(ns) for r, ns in by_rank.items()})


