"""Canonical forms: a param's layouts with ranks renumbered, so that params differing only by
which ranks hold them share one ``FormPlanner`` and its templates."""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

from refit.plan.geometry import GeometryCache
from refit.plan.roster import TensorLayout
from refit.plan.templates import FormPlanner


class Form(NamedTuple):
    """A param's layouts with canonical ranks (and canonical fan-out domain labels, or None)."""

    src: TensorLayout
    dsts: tuple[TensorLayout, ...]
    domains: tuple[int, ...] | None


class DstOffsets(NamedTuple):
    """Canonical offsets among a param's destination layouts."""

    where: dict[int, int]  # rank -> its canonical offset among the destination layouts
    starts: tuple[int, ...]  # each layout's first offset


class FormLookup(NamedTuple):
    """A param's form and the maps between its canonical indices and real ranks."""

    form: Form
    ranks: Any  # canonical index -> rank (a tuple, or a DisjointMap)
    to_canonical: Any  # rank -> canonical index (a dict, or a DisjointMap)

    def canonical(self, rank: int) -> int:
        to_c = self.to_canonical
        return to_c.canonical(rank) if isinstance(to_c, DisjointMap) else to_c[rank]


class DisjointMap:
    """Canonical index <-> rank for layouts whose source mesh shares no rank with the
    destinations: index ``i < n`` is source mesh position ``i``, the rest run through the
    destination layouts in order. Costs nothing per param beyond the lookups it serves."""

    __slots__ = ("src", "dsts", "where", "offsets", "n")

    def __init__(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], info: DstOffsets, n: int):
        self.src, self.dsts = src, dsts
        self.where, self.offsets = info.where, info.starts
        self.n = n

    def __getitem__(self, x: int) -> int:  # canonical index -> rank
        if x < self.n:
            return self.src.mesh_ranks[x]
        x -= self.n
        g = bisect.bisect_right(self.offsets, x) - 1
        return self.dsts[g].mesh_ranks[x - self.offsets[g]]

    def canonical(self, rank: int) -> int:  # rank -> canonical index
        i = self.src.position(rank)
        return i if i is not None else self.n + self.where[rank]


class PlannerCache(GeometryCache):
    """One index's planning state: canonical forms, geometry and templates, filled on demand
    (a ``PlanCache`` keeps one per index digest).

    A form is a param's source and destination layouts with ranks renumbered by first
    appearance (source mesh, then each destination mesh): params whose layouts differ
    only by which ranks hold them (the layers of one pipeline stage, the experts of one
    EP rank) share a form, and so share their geometry and templates.
    """

    def __init__(self):
        super().__init__()
        self._forms: dict[tuple, tuple] = {}
        self._by_id: dict[tuple, tuple] = {}
        self._form_objects: dict[tuple, tuple] = {}
        self._dst_infos: dict[tuple, tuple] = {}
        self._canon_dsts: dict[tuple, tuple] = {}
        self._canon_layouts: dict[tuple, TensorLayout] = {}
        self._planners: dict[tuple, FormPlanner] = {}

    def form(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], domains) -> FormLookup:
        """One param's form, and the maps between its canonical indices and real ranks.

        Looked up by object identity first: the params of one model share their layout
        objects, and hashing a tuple of hundreds of engine layouts per param would make
        a rank's work grow with the engine count."""
        key = (id(src), id(dsts), id(domains))
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is src and hit[1] is dsts and hit[2] is domains:
            return hit[3]
        got = self._form(src, dsts, domains)
        self._by_id[key] = (src, dsts, domains, got)
        return got

    def _form(self, src: TensorLayout, dsts: tuple[TensorLayout, ...], domains) -> FormLookup:
        if domains is None:
            info = self._dst_info(dsts)
            if not any(r in info.where for r in src.mesh_ranks):
                # the usual case, sources and destinations on different ranks: canonical
                # indices are the source mesh positions, then the destination layouts' in order
                n = len(src.mesh_ranks)
                cdsts = self._canon_dsts.get((dsts, n))
                if cdsts is None:
                    cdsts = self._canon_dsts[(dsts, n)] = tuple(
                        self._canon_range(d, n + off) for d, off in zip(dsts, info.starts))
                form = self._interned(Form(self._canon_range(src, 0), cdsts, None))
                m = DisjointMap(src, dsts, info, n)
                return FormLookup(form, m, m)
        key = (src, dsts, domains)
        got = self._forms.get(key)
        if got is None:
            to_c: dict[int, int] = {}
            for lay in (src, *dsts):
                for r in lay.mesh_ranks:
                    if r not in to_c:
                        to_c[r] = len(to_c)
            ranks = tuple(to_c)
            cdoms = None
            if domains is not None:
                labels: dict[Any, int] = {}
                cdoms = tuple(labels.setdefault(domains[r], len(labels)) for r in ranks)
            form = self._interned(Form(self._canon(src, to_c), tuple(self._canon(d, to_c) for d in dsts), cdoms))
            got = self._forms[key] = FormLookup(form, ranks, to_c)
        return got

    def _interned(self, form: Form) -> Form:
        """One object per distinct form, so that later lookups key on its identity."""
        return self._form_objects.setdefault(form, form)

    def _dst_info(self, dsts: tuple[TensorLayout, ...]) -> DstOffsets:
        info = self._dst_infos.get(dsts)
        if info is None:
            where: dict[int, int] = {}
            offsets = []
            for lay in dsts:
                offsets.append(len(where))
                for r in lay.mesh_ranks:
                    where[r] = len(where)
            info = self._dst_infos[dsts] = DstOffsets(where, tuple(offsets))
        return info

    def _canon_range(self, layout: TensorLayout, first: int) -> TensorLayout:
        key = (tuple(range(first, first + len(layout.mesh_ranks))), layout.mesh_shape, layout.placements, layout.dtype)
        lay = self._canon_layouts.get(key)
        if lay is None:
            lay = self._canon_layouts[key] = TensorLayout(*key)
        return lay

    def _canon(self, layout: TensorLayout, to_c: dict[int, int]) -> TensorLayout:
        ranks = tuple(to_c[r] for r in layout.mesh_ranks)
        key = (ranks, layout.mesh_shape, layout.placements, layout.dtype)
        lay = self._canon_layouts.get(key)
        if lay is None:
            lay = self._canon_layouts[key] = TensorLayout(*key)
        return lay

    def planner(self, shape, form, bucket_bytes: int, stripe_bytes: int | None) -> FormPlanner:
        key = (shape, id(form), bucket_bytes, stripe_bytes)  # forms are interned: see _form
        fp = self._planners.get(key)
        if fp is None:
            fp = self._planners[key] = FormPlanner(shape, form, self, bucket_bytes, stripe_bytes)
        return fp
