"""Parallel layouts from short strings, and the planner's ``ParamIndex`` from a model spec.

Training side (Megatron-core conventions)::

    tp=8,pp=8,ep=32,etp=1          # dp = world / (tp*cp*pp) when a world size is given
    keys: tp, pp, dp, cp, ep, etp  # etp defaults to tp, as in Megatron-core

Ranks are numbered Megatron's default way, ``tp`` fastest, then ``cp``, ``dp``, ``pp``
(order ``tp-cp-ep-dp-pp``). A dense tensor of a layer lives on the ranks of that layer's
pipeline stage, as a ``[dp, cp, tp]`` mesh replicated over dp and cp and cut over tp by
its kind (see ``refit.models.specs``). Routed experts use the expert decomposition of the
same stage, ``etp`` fastest, then ``ep``, then the expert-data-parallel ``edp``: expert
``e`` lives on EP rank ``e // (experts / ep)``, as an ``[edp, etp]`` mesh. Layers are split
over stages as evenly as possible, earlier stages taking the remainder; the embedding
sits on the first stage, the final norm, the head and any MTP layers on the last.

Engine side (vLLM conventions)::

    tp=8,dp=16,ep=128              # keys: tp, dp, ep
    ranks: replica d holds ranks  offset + d*tp ... offset + d*tp + tp - 1

Each data-parallel replica is its own destination layout (a ``[tp]`` mesh). When ``tp``
exceeds the key/value heads, ranks share heads: k/v projections use a ``[heads,
tp/heads]`` mesh, ``Shard(0)`` over heads and ``Replicate()`` over the ranks sharing one.
With ``ep`` set, routed experts are cut by expert over groups of ``ep`` consecutive engine
ranks (``ep`` divides ``tp*dp``; each group is a destination layout); without it they are
cut by tensor parallelism inside each replica, like the dense MLP.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from refit.errors import LayoutError
from refit.layout import Placement, Replicate, Shard
from refit.models.specs import ModelSpec, ParamShape
from refit.plan import ParamIndex, ParamSpec, RosterEntry, RosterGroup, TensorLayout
from refit.plan.quant import BlockFp8, scale_name, scale_placements


def _parse(text: str, allowed: Iterable[str], what: str) -> dict[str, int]:
    out: dict[str, int] = {}
    allowed = tuple(allowed)
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise LayoutError(f"{what} layout {text!r}: expected key=value pairs like 'tp=8,pp=4', got {part!r}")
        key, value = part.split("=", 1)
        key = key.lower()
        if key not in allowed:
            raise LayoutError(f"{what} layout {text!r}: unknown key {key!r}; use {', '.join(allowed)}")
        try:
            n = int(value)
        except ValueError:
            raise LayoutError(f"{what} layout {text!r}: {key} must be an integer, got {value!r}") from None
        if n < 1:
            raise LayoutError(f"{what} layout {text!r}: {key} must be at least 1, got {n}")
        out[key] = n
    return out


@dataclass(frozen=True)
class TrainParallel:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def stage_size(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def world(self) -> int:
        return self.stage_size * self.pp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.expert_tp * self.ep)

    def describe(self) -> str:
        etp = "" if self.etp is None else f",etp={self.etp}"
        cp = "" if self.cp == 1 else f",cp={self.cp}"
        return f"tp={self.tp},pp={self.pp},dp={self.dp}{cp},ep={self.ep}{etp}"

    def check(self, model: ModelSpec) -> None:
        if self.stage_size % (self.expert_tp * self.ep):
            raise LayoutError(f"train layout {self.describe()}: etp*ep = {self.expert_tp * self.ep} must divide "
                              f"tp*cp*dp = {self.stage_size} (the ranks of one pipeline stage)")
        if model.num_experts and model.num_experts % self.ep:
            raise LayoutError(f"train layout {self.describe()}: ep={self.ep} must divide the "
                              f"{model.num_experts} experts of {model.name}")
        if self.ep > 1 and not model.num_experts:
            raise LayoutError(f"train layout {self.describe()}: ep={self.ep} but {model.name} has no experts")
        if self.pp > model.num_stored_layers:
            raise LayoutError(f"train layout {self.describe()}: pp={self.pp} exceeds the "
                              f"{model.num_stored_layers} layers of {model.name}")
        _check_kv(model, self.tp, "train")

    def stage_layers(self, num_layers: int) -> list[range]:
        base, extra = divmod(num_layers, self.pp)
        out, start = [], 0
        for s in range(self.pp):
            n = base + (1 if s < extra else 0)
            out.append(range(start, start + n))
            start += n
        return out


@dataclass(frozen=True)
class EngineParallel:
    tp: int = 1
    dp: int = 1
    ep: int = 0  # 0: experts cut by TP inside each replica

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def describe(self) -> str:
        return f"tp={self.tp},dp={self.dp}" + (f",ep={self.ep}" if self.ep else "")

    def check(self, model: ModelSpec) -> None:
        if self.ep:
            if self.world % self.ep:
                raise LayoutError(f"engine layout {self.describe()}: ep={self.ep} must divide tp*dp = {self.world}")
            if not model.num_experts:
                raise LayoutError(f"engine layout {self.describe()}: ep={self.ep} but {model.name} has no experts")
            if model.num_experts % self.ep:
                raise LayoutError(f"engine layout {self.describe()}: ep={self.ep} must divide the "
                                  f"{model.num_experts} experts of {model.name}")
        _check_kv(model, self.tp, "engine")


def _check_kv(model: ModelSpec, tp: int, side: str) -> None:
    if model.mla:
        return
    kv = model.num_kv_heads
    if tp > kv and tp % kv:
        raise LayoutError(f"{side} tp={tp} exceeds {kv} key/value heads of {model.name} without being a multiple "
                          "of them; ranks can only share whole heads")
    if tp <= kv and kv % tp:
        raise LayoutError(f"{side} tp={tp} does not divide the {kv} key/value heads of {model.name}")


def parse_train(text: str, *, world: int | None = None) -> TrainParallel:
    """``tp=8,pp=4,ep=8`` -> ``TrainParallel``; ``dp`` is derived from ``world`` when left out."""
    kv = _parse(text, ("tp", "pp", "dp", "cp", "ep", "etp"), "train")
    tp, pp, cp = kv.get("tp", 1), kv.get("pp", 1), kv.get("cp", 1)
    if "dp" not in kv:
        if world is None:
            dp = 1
        elif world % (tp * pp * cp):
            raise LayoutError(f"train layout {text!r}: {world} ranks are not a multiple of tp*cp*pp = {tp * cp * pp}")
        else:
            dp = world // (tp * pp * cp)
    else:
        dp = kv["dp"]
    out = TrainParallel(tp=tp, pp=pp, dp=dp, cp=cp, ep=kv.get("ep", 1), etp=kv.get("etp"))
    if world is not None and out.world != world:
        raise LayoutError(f"train layout {text!r} spans {out.world} ranks, not {world}")
    return out


def parse_engine(text: str, *, world: int | None = None) -> EngineParallel:
    """``tp=8,dp=16,ep=128`` -> ``EngineParallel``; ``dp`` is derived from ``world`` when left out."""
    kv = _parse(text, ("tp", "dp", "ep"), "engine")
    tp = kv.get("tp", 1)
    if "dp" not in kv:
        if world is None:
            dp = 1
        elif world % tp:
            raise LayoutError(f"engine layout {text!r}: {world} ranks are not a multiple of tp = {tp}")
        else:
            dp = world // tp
    else:
        dp = kv["dp"]
    out = EngineParallel(tp=tp, dp=dp, ep=kv.get("ep", 0))
    if world is not None and out.world != world:
        raise LayoutError(f"engine layout {text!r} spans {out.world} ranks, not {world}")
    return out


# -- layouts ---------------------------------------------------------------------------------

def _tp_placements(p: ParamShape, tp: int) -> tuple[tuple[int, ...], tuple[Placement, ...]]:
    """Mesh shape and placements of one TP group for a tensor of kind ``p.kind``."""
    kind = p.kind
    if kind in ("col", "vocab", "ecol"):
        return (tp,), (Shard(0),)
    if kind in ("row", "erow"):
        return (tp,), (Shard(1),)
    if kind == "rep":
        return (tp,), (Replicate(),)
    if kind == "kv":
        heads = p.heads or tp
        if tp > heads:
            return (heads, tp // heads), (Shard(0), Replicate())
        return (tp,), (Shard(0),)
    raise LayoutError(f"{p.name}: unknown sharding kind {kind!r}")


def squeeze_mesh(shape: tuple[int, ...], placements: tuple[Placement, ...]):
    """Drop mesh dims of size 1 (they change nothing), keeping at least one."""
    keep = [i for i, n in enumerate(shape) if n > 1]
    if not keep:
        return (1,), (Replicate(),)
    return tuple(shape[i] for i in keep), tuple(placements[i] for i in keep)


class LayoutBuilder:
    """Builds (and interns) the source and destination layouts of every tensor of a model."""

    def __init__(self, model: ModelSpec, train: TrainParallel, engine: EngineParallel, *,
                 train_dtype: str | None = None, engine_dtype: str | None = None, engine_offset: int | None = None):
        train.check(model)
        engine.check(model)
        self.model, self.train, self.engine = model, train, engine
        self.train_dtype = train_dtype or model.dtype
        # "fp8": the engine keeps its linear weights in 128 x 128 block-scaled float8_e4m3fn (with
        # their scales, laid out like them), everything else in the model's dtype
        self.quant = BlockFp8() if engine_dtype == "fp8" else None
        self.engine_dtype = model.dtype if self.quant or not engine_dtype else engine_dtype
        self.engine_offset = train.world if engine_offset is None else engine_offset
        if self.engine_offset < train.world:
            raise LayoutError(f"engine ranks start at {self.engine_offset}, inside the {train.world} training ranks")
        self.world = self.engine_offset + engine.world
        self._layouts: dict[tuple, TensorLayout] = {}
        self._src: dict[tuple, TensorLayout] = {}
        self._dst: dict[tuple, tuple[TensorLayout, ...]] = {}
        self._stage_of: dict[int, int] = {}
        for s, layers in enumerate(train.stage_layers(model.num_stored_layers)):
            for layer in layers:
                self._stage_of[layer] = s
        self._experts_per_rank = model.num_experts // train.ep if model.num_experts else 0
        self._experts_per_engine_rank = model.num_experts // engine.ep if (model.num_experts and engine.ep) else 0

    def _intern(self, ranks: Iterable[int], shape, placements, dtype) -> TensorLayout:
        ranks = tuple(int(r) for r in ranks)
        key = (ranks, tuple(shape), tuple(placements), dtype)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = TensorLayout(ranks, tuple(shape), tuple(placements), dtype)
        return lay

    def quantized(self, p: ParamShape) -> bool:
        """Whether an FP8 engine keeps ``p`` in FP8: the matrices of the linear layers (as the
        FP8 checkpoints of DeepSeek-V3 and Kimi-K2 do), not the embeddings, head, router or norms."""
        return (self.quant is not None and p.scales_of is None and len(p.shape) == 2 and p.kind != "vocab"
                and p.name.endswith(".weight") and not p.name.endswith("mlp.gate.weight"))

    @cached_property
    def _fp8_weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """A scale grid's name -> its FP8 weight's shape (the grid alone does not give it back)."""
        return {scale_name(p.name): p.shape for p in self.model.params() if self.quantized(p)}

    def params(self) -> Iterator[ParamShape]:
        """The model's tensors, each FP8 weight followed by its block scales (``..._scale_inv``)."""
        for p in self.model.params():
            yield p
            if self.quantized(p):
                yield dataclasses.replace(p, name=scale_name(p.name), shape=self.quant.scale_shape(p.shape),
                                          scales_of=p.name)

    def stage_of(self, layer: int) -> int:
        if layer < 0:
            return 0
        return self._stage_of.get(layer, self.train.pp - 1)

    def src(self, p: ParamShape) -> TensorLayout:
        if p.scales_of is not None:
            # sharded like the weight where its shards hold whole blocks (each rank makes its own
            # blocks' scales); otherwise every source rank merges the block amaxes and holds the grid
            lay = self._src_of(dataclasses.replace(p, scales_of=None))
            placements = scale_placements(self._fp8_weight_shapes[p.name], lay.mesh_shape, lay.placements,
                                          self.quant.block)
            return self._intern(lay.mesh_ranks, lay.mesh_shape,
                                placements if placements is not None else (Replicate(),) * len(lay.mesh_shape),
                                self.quant.scale_dtype)
        return self._src_of(p)

    def _src_of(self, p: ParamShape) -> TensorLayout:
        t = self.train
        stage = self.stage_of(p.layer)
        base = stage * t.stage_size
        if p.expert is not None:
            etp, ep, edp = t.expert_tp, t.ep, t.edp
            j = p.expert // self._experts_per_rank
            key = ("e", stage, j, p.kind)
            lay = self._src.get(key)
            if lay is None:
                ranks = [base + x + etp * (j + ep * d) for d in range(edp) for x in range(etp)]
                shape, places = squeeze_mesh((edp, etp), (Replicate(), Shard(0 if p.kind == "ecol" else 1)))
                lay = self._src[key] = self._intern(ranks, shape, places, self.train_dtype)
            return lay
        key = ("d", stage, p.kind, p.heads)
        lay = self._src.get(key)
        if lay is None:
            tp_shape, tp_places = _tp_placements(p, t.tp)
            shape, places = squeeze_mesh((t.dp, t.cp) + tp_shape, (Replicate(), Replicate()) + tp_places)
            lay = self._src[key] = self._intern(range(base, base + t.stage_size), shape, places, self.train_dtype)
        return lay

    def dsts(self, p: ParamShape) -> tuple[TensorLayout, ...]:
        lays = self._dsts_of(p)
        if p.scales_of is not None or self.quantized(p):
            dtype = self.quant.scale_dtype if p.scales_of is not None else self.quant.dtype_name
            key = ("q", lays, dtype)
            out = self._dst.get(key)
            if out is None:
                out = self._dst[key] = tuple(self._intern(lay.mesh_ranks, lay.mesh_shape, lay.placements, dtype)
                                             for lay in lays)
            return out
        return lays

    def _dsts_of(self, p: ParamShape) -> tuple[TensorLayout, ...]:
        e = self.engine
        off = self.engine_offset
        if p.expert is not None and e.ep:
            j = p.expert // self._experts_per_engine_rank
            key = ("e", j)
            lays = self._dst.get(key)
            if lays is None:
                lays = self._dst[key] = tuple(
                    self._intern([off + q * e.ep + j], (1,), (Replicate(),), self.engine_dtype)
                    for q in range(e.world // e.ep))
            return lays
        key = ("d", p.kind, p.heads)
        lays = self._dst.get(key)
        if lays is None:
            tp_shape, tp_places = _tp_placements(p, e.tp)
            shape, places = squeeze_mesh(tp_shape, tp_places)
            lays = self._dst[key] = tuple(
                self._intern(range(off + d * e.tp, off + (d + 1) * e.tp), shape, places, self.engine_dtype)
                for d in range(e.dp))
        return lays


def build_index(model: ModelSpec, train: TrainParallel, engine: EngineParallel, **kwargs) -> ParamIndex:
    """The merged ``ParamIndex`` of a whole model, built straight from the layouts.

    Equal to ``merge_rosters(build_rosters(...))`` (tested on small configs), without
    materialising hundreds of per-rank roster lists: tensors sharing their layouts are
    grouped, so the cost is one pass over the tensors plus one per distinct layout set.
    """
    b = LayoutBuilder(model, train, engine, **kwargs)
    specs: dict[str, ParamSpec] = {}
    groups: dict[tuple, list[str]] = defaultdict(list)
    for p in b.params():
        src, dsts = b.src(p), b.dsts(p)
        specs[p.name] = ParamSpec(p.name, p.shape, src, dsts)
        groups[(src, dsts)].append(p.name)
    by_rank: dict[int, list[str]] = defaultdict(list)
    for (src, dsts), names in groups.items():
        for lay in (src, *dsts):
            for r in lay.mesh_ranks:
                by_rank[r].extend(names)
    return ParamIndex(b.world, specs, {r: sorted(ns) for r, ns in sorted(by_rank.items())})


def build_rosters(model: ModelSpec, train: TrainParallel, engine: EngineParallel,
                  **kwargs) -> dict[int, list[RosterEntry]]:
    """Per-rank roster entries, as every rank would report them (for ``merge_rosters``)."""
    b = LayoutBuilder(model, train, engine, **kwargs)
    rosters: dict[int, list[RosterEntry]] = {r: [] for r in range(b.world)}
    for p in b.params():
        for role, lays in (("src", (b.src(p),)), ("dst", b.dsts(p))):
            for lay in lays:
                mesh = np.array(lay.mesh_ranks).reshape(lay.mesh_shape)
                for r in lay.mesh_ranks:
                    rosters[r].append(RosterEntry.make(p.name, p.shape, lay.dtype, mesh, list(lay.placements), role))
    return rosters


def build_roster_groups(model: ModelSpec, train: TrainParallel, engine: EngineParallel,
                        **kwargs) -> dict[int, list[RosterGroup]]:
    """Per-rank roster groups, as every rank reports them at run time (for ``merge_rosters``).

    Each rank gets its own group records, one per layout it has, as ``refit.plan.group_roster``
    would make them from its entries; ranks of one mesh share the name tuples (what a rank
    sends is the same either way, and the merge reads each distinct group's names once).
    """
    b = LayoutBuilder(model, train, engine, **kwargs)
    pairs: dict[tuple[int, int], tuple] = {}  # params sharing their layout objects, then each layout's params
    for p in b.params():
        src, dsts = b.src(p), b.dsts(p)
        got = pairs.get((id(src), id(dsts)))
        if got is None:
            got = pairs[(id(src), id(dsts))] = (src, dsts, [], [])
        got[2].append(p.name)
        got[3].append(p.shape)
    per_layout: dict[tuple[TensorLayout, str], tuple[list[str], list[tuple[int, ...]]]] = {}
    for src, dsts, names, shapes in pairs.values():
        for role, lays in (("src", (src,)), ("dst", dsts)):
            for lay in lays:
                got = per_layout.get((lay, role))
                if got is None:
                    got = per_layout[(lay, role)] = ([], [])
                got[0].extend(names)
                got[1].extend(shapes)
    protos: dict[tuple, RosterGroup] = {}  # one sorted name tuple and digest per distinct name list
    rosters: dict[int, list[RosterGroup]] = {r: [] for r in range(b.world)}
    for (lay, role), (names, shapes) in per_layout.items():
        key = (tuple(names), tuple(shapes))
        proto = protos.get(key)
        if proto is None:
            order = sorted(range(len(names)), key=names.__getitem__)
            proto = protos[key] = RosterGroup.make([names[i] for i in order], [shapes[i] for i in order],
                                                   lay.dtype, [], [], role)
        mesh = np.array(lay.mesh_ranks).reshape(lay.mesh_shape).tolist()
        for r in lay.mesh_ranks:
            rosters[r].append(RosterGroup(proto.names, proto.shapes, lay.dtype, mesh, list(lay.placements), role,
                                          proto.digest))
    return rosters


def node_map(train_world: int, engine_offset: int, world: int, gpus_per_node: int) -> list[int]:
    """Node of every rank: training ranks fill nodes from 0, engine ranks start on a fresh node."""
    nodes = []
    first_engine_node = -(-engine_offset // gpus_per_node)
    for r in range(world):
        engine_node = first_engine_node + (r - engine_offset) // gpus_per_node
        nodes.append(r // gpus_per_node if r < engine_offset else engine_node)
    return nodes


__all__ = ["EngineParallel", "LayoutBuilder", "TrainParallel", "build_index", "build_roster_groups", "build_rosters",
           "node_map",
           "parse_engine", "parse_train", "squeeze_mesh"]
