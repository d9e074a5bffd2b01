"""The per-entry merge as it was before rosters were grouped: the reference that
``merge_rosters`` (groups, read once per distinct group) is held to, index for index."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np

from refit.errors import PlanError
from refit.layout import validate_layout
from refit.plan import ParamIndex, ParamSpec, RosterEntry, TensorLayout


def _layout_key(e: RosterEntry) -> tuple | None:
    """A content key for an entry's (mesh, placements, dtype), or None when it has none."""
    m = e.mesh
    if isinstance(m, np.ndarray):
        mk = ("np", m.shape, m.dtype.str, m.tobytes())
    elif isinstance(m, (list, tuple)):
        mk = ("seq", repr(m))
    else:
        return None
    pl = e.placements
    pk = tuple(pl) if isinstance(pl, (list, tuple)) else (pl,)
    try:
        hash(pk)
    except TypeError:
        return None
    return (mk, pk, str(e.dtype))


def reference_merge(rosters: Mapping[int, Iterable[RosterEntry]], world_size: int) -> ParamIndex:
    """Check the per-rank rosters against each other and merge them into one spec per param.

    Raises ``PlanError`` / ``LayoutError`` naming the param and the ranks for: a
    destination that no source holds, a shape mismatch, placements that do not fit the
    mesh, a mesh rank outside the group, a rank listed twice, a mesh rank that did not
    report the param, and a rank in two destination layouts of one param.
    """
    seen: dict[tuple[str, str], dict[TensorLayout, list[int]]] = defaultdict(dict)
    shapes: dict[str, dict[tuple[int, ...], list[int]]] = defaultdict(dict)
    # A model's hundreds of thousands of entries repeat a few hundred layouts: build and
    # check each distinct one once (the first entry that has it is the one an error names).
    made: dict[tuple, TensorLayout] = {}
    valid: set[tuple] = set()
    for rank in sorted(rosters):
        if not 0 <= rank < world_size:
            raise PlanError(f"roster from rank {rank}, outside the process group of world size {world_size}")
        for e in rosters[rank]:
            key = _layout_key(e)
            layout = made.get(key) if key is not None else None
            if layout is None:
                layout = TensorLayout.make(e.mesh, e.placements, e.dtype, param=e.name)
                if key is not None:
                    made[key] = layout
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


