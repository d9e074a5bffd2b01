"""A declared cluster topology, the simulated time of a refit plan on it, and the bandwidth
lower bound that time is measured against.

The model, simple on purpose so that it can be argued with:

* Every GPU rank has four ports, each streaming at a declared rate: NIC out and NIC in
  (``nic_gbps`` GB/s per GPU, one direction; the fabric is taken as rail-optimized and
  non-blocking, so only the ports limit), NVLink out and NVLink in (``nvlink_gbps``).
* A bucket is a flow from its sender to its receiver: over NVLink when both ranks sit on
  one node, else over the two NICs.
* Buckets that need no staging (one contiguous block, no cast) are all posted at once
  by the transport and count as one round together; each staged bucket index is a round.
* A refit runs in phases: the plan's sends and receives, then, with fan-out, the
  all-gather inside the replica groups (``refit.transport.fanout`` runs them in that order, with a
  barrier between). Within a phase, flows are spread over its length (the transport
  keeps several rounds and every peer in flight, NCCL many channels), so a port is busy
  for its bytes / bandwidth, and the phase lasts as long as its busiest port, plus
  ``latency_us`` for each round of buckets on the rank that runs the most rounds.
* Every message (bucket) costs its rank ``message_us`` of fixed overhead besides its
  bytes, on top of the per-round latency: posting, matching and completing a send or a
  receive. DESIGN.md's anchors put it at 12-18 us per message for NCCL's batched
  send/recv on H200 (1000 x 1 MiB in 21 ms, 4000 x 256 KiB in 52 ms, against 2.9 ms of
  bytes at 370 GB/s), so 15 us by default.
* Local copies (a rank that is source and destination of one param) go over HBM and
  are not counted.

So ``simulated time = sum over phases of (max over ranks of (its busiest port's bytes /
bandwidth + message_us x its messages) + latency x rounds)``.

The model ignores congestion inside the fabric and the compute of packing (both matter
on real clusters: read it as what the plan's load distribution permits).

Connections are priced apart (``Connections``, ``connection_costs``): every distinct peer
of a rank is a connection that a build sets up once and that holds memory while it lives.

The lower bound (``lower_bound``) is computed from the rosters alone, never from a plan:
it is the largest of what any plan must spend on one port, namely

* a destination rank must receive every element of its shards that it does not hold: over its
  NIC what only other nodes hold, over NVLink what only its node holds, over either what both hold
  (a plan may take a copy from the far node over the NIC while NVLink is busy), so the longest of
  NIC-only / NIC, NVLink-only / NVLink and all / (NIC + NVLink);
* sources must send what destinations need: one copy per destination rank for
  point-to-point delivery, one copy per element when destinations may relay (fan-out).
  The bytes owed by shards whose holders all lie inside a set ``U`` of ranks must leave
  through ``U``'s ports, so ``max over replica sets U of owed(U) / |U| / bandwidth``, split so too;
* with relaying inside nodes, a node's NICs together bring in every element its ranks
  need and do not hold: distinct bytes / (GPUs of the node x NIC); and a rank takes in
  what it needs over its NIC and NVLink together.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit.layout import region_numel, region_overlap_numel
from refit.plan import ParamIndex, RankPlan, itemsize, wire_dtype
from refit.plan.geometry import GeometryCache

PORTS = ("nic_out", "nic_in", "nvl_out", "nvl_in")
NIC, NVL, EITHER = 0, 1, 2  # which of a rank's links some bytes can take


def link_between(holder_nodes: set[int], node: int) -> int:
    """The links a rank on ``node`` can get bytes over from holders on ``holder_nodes``."""
    return NIC if node not in holder_nodes else NVL if len(holder_nodes) == 1 else EITHER


def fastest_split(by_link: Sequence[float], nic_bw: float, nvl_bw: float) -> tuple[float, str]:
    """Least seconds for bytes ``[NIC-only, NVLink-only, either]`` over a NIC and an NVLink at once; what limits it."""
    return max((by_link[NIC] / nic_bw, "NIC"), (by_link[NVL] / nvl_bw, "NVLink"),
               (sum(by_link) / (nic_bw + nvl_bw), "NVLink and NIC"))


@dataclass(frozen=True)
class Topology:
    """GPUs per node, NVLink and NIC bandwidth per GPU (GB/s, one direction), per-round latency.

    ``nodes`` gives the node of every rank; without it rank ``r`` sits on node
    ``r // gpus_per_node``.
    """

    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0
    nic_gbps: float = 50.0  # 400 Gb/s
    latency_us: float = 20.0
    nodes: tuple[int, ...] | None = None
    message_us: float = 15.0  # fixed cost per message (bucket) on its rank, besides its bytes

    def node(self, rank: int) -> int:
        if self.nodes is not None and rank < len(self.nodes):
            return self.nodes[rank]
        return rank // self.gpus_per_node

    def bandwidth(self, port: str) -> float:
        return (self.nic_gbps if port.startswith("nic") else self.nvlink_gbps) * 1e9

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs/node, NVLink {self.nvlink_gbps:g} GB/s, NIC {self.nic_gbps:g} GB/s "
                f"({self.nic_gbps * 8:g} Gb/s) per GPU, {self.latency_us:g} us per round, "
                f"{self.message_us:g} us per message")


@dataclass(frozen=True)
class Connections:
    """What each distinct peer of a rank costs a build: set-up time and memory.

    ``setup_s`` is paid once per peer per build, one peer after another on a rank (ranks
    in parallel); ``memory_bytes`` is held per peer while the communicator lives. The
    figures are documented ones, cited in ``source`` and in docs/scale.md.
    """

    name: str
    setup_s: float
    memory_bytes: int
    source: str


# NCCL sets up a send/recv connection on first use, per peer (NCCL issue #415: "Send/Recv
# connections are established on demand"; the first send/recv to a peer took 10-100 ms
# there, so 10 ms); each holds NCCL_BUFFSIZE (4 MiB) per channel, NCCL_NCHANNELS_PER_NET_PEER
# (2) channels, one way and back (NCCL environment variable docs): 16 MiB.
NCCL = Connections("nccl", 0.010, 2 * 2 * (4 << 20),
                   "NCCL env docs (NCCL_BUFFSIZE 4 MiB, NCCL_NCHANNELS_PER_NET_PEER 2); NCCL issue #415")
# NIXL loads each peer's agent metadata and makes its UCX endpoint: ~800 ms for 8 peers fetched
# one after another (ai-dynamo/nixl PR #1132), so 100 ms a peer; its memory is the registered
# buffers, whatever the peer count, so none per peer.
NIXL = Connections("nixl", 0.100, 0, "ai-dynamo/nixl PR #1132 (8 peers, 800 ms sequential)")
CONNECTIONS = (NCCL, NIXL)


def connection_costs(peers: Sequence[int], conn: Connections) -> dict:
    """Set-up seconds and memory of the busiest rank (by peers) under ``conn``."""
    most = max(peers, default=0)
    return {"transport": conn.name, "max_peers": most, "setup_seconds": most * conn.setup_s,
            "memory_bytes": most * conn.memory_bytes, "source": conn.source}


@dataclass
class RankTraffic:
    """One rank's bytes per port and rounds, per phase (0: sources -> destinations, 1: all-gather)."""

    rank: int
    ports: list[dict[str, int]] = field(default_factory=lambda: [dict.fromkeys(PORTS, 0), dict.fromkeys(PORTS, 0)])
    rounds: list[int] = field(default_factory=lambda: [0, 0])
    buckets: list[int] = field(default_factory=lambda: [0, 0])
    local_bytes: int = 0
    peers: int = 0  # distinct ranks it sends to or receives from, both phases

    @property
    def bytes_sent(self) -> int:
        return sum(p["nic_out"] + p["nvl_out"] for p in self.ports)

    @property
    def bytes_received(self) -> int:
        return sum(p["nic_in"] + p["nvl_in"] for p in self.ports)

    def busy(self, phase: int, topo: Topology) -> float:
        """Seconds this rank needs in ``phase``: its busiest port, plus its messages' fixed costs."""
        return self.port_seconds(phase, topo) + self.buckets[phase] * topo.message_us * 1e-6

    def port_seconds(self, phase: int, topo: Topology) -> float:
        return max(self.ports[phase][p] / topo.bandwidth(p) for p in PORTS)


def delta_wire_bytes(changed: float) -> Callable[[Any], int]:
    """A bucket's bytes on the wire in a delta refit where ``changed`` of its words differ from the
    receiver's version: the smallest of dense, bitmask plus values, and indices plus values
    (``refit.transport.delta``), its words the bucket's narrowest wire element."""
    from refit.transport.delta import choose_format, encoded_bytes

    def wire(b) -> int:
        width = min(itemsize(op.wire_dtype) for op in b.ops) if b.ops else 1
        width = width if width in (1, 2, 4) else 4
        words = b.nbytes // width
        k = round(changed * words)
        return encoded_bytes(choose_format(words, width, k), words, width, k)

    return wire


def _full(b) -> int:
    return b.nbytes


def traffic_of(plan: RankPlan, topo: Topology, wire: Callable[[Any], int] = _full) -> RankTraffic:
    """Bytes per port and phase of one rank's plan on ``topo`` (one pass over its buckets);
    ``wire`` gives a bucket's bytes on the wire (``delta_wire_bytes``: a delta refit)."""
    t = RankTraffic(plan.rank)
    node = topo.node
    me = node(plan.rank)
    peers: set[int] = set()
    for phase, (sends, recvs) in enumerate(((plan.sends, plan.recvs), (plan.gather_sends, plan.gather_recvs))):
        ports = t.ports[phase]
        staged: set[int] = set()
        direct = False
        for buckets, near, far in ((sends, "nvl_out", "nic_out"), (recvs, "nvl_in", "nic_in")):
            for b in buckets:
                ports[near if node(b.peer) == me else far] += wire(b)
                if len(b.ops) == 1 and b.ops[0].direct:
                    direct = True
                else:
                    staged.add(b.index)
                peers.add(b.peer)
        t.rounds[phase] = len(staged) + (1 if direct else 0)
        t.buckets[phase] = len(sends) + len(recvs)
    t.local_bytes = plan.local_bytes
    t.peers = len(peers)
    return t


class Receipts:
    """The traffic of a rank that only receives, in a plan without fan-out, gathered from its
    senders' buckets to it (both ends cut the same buckets), so its own plan need not be built:
    ``add`` each sender's buckets to it, then ``traffic`` gives what ``traffic_of`` would give."""

    __slots__ = ("rank", "node", "nic_in", "nvl_in", "staged", "direct", "buckets", "peers")

    def __init__(self, rank: int, topo: Topology):
        self.rank, self.node = rank, topo.node(rank)
        self.nic_in = self.nvl_in = self.buckets = 0
        self.staged: set[int] = set()
        self.direct = False
        self.peers: set[int] = set()

    def add(self, sender: int, buckets, topo: Topology, wire: Callable[[Any], int] = _full) -> None:
        """``sender``'s buckets to this rank (``wire``: a bucket's bytes on the wire, as ``traffic_of``)."""
        nbytes = sum(wire(b) for b in buckets)
        if topo.node(sender) == self.node:
            self.nvl_in += nbytes
        else:
            self.nic_in += nbytes
        for b in buckets:
            if len(b.ops) == 1 and b.ops[0].direct:
                self.direct = True
            else:
                self.staged.add(b.index)
        self.peers.add(sender)
        self.buckets += len(buckets)

    def merge(self, other: Receipts) -> None:
        """Add what another process gathered for this rank."""
        self.nic_in += other.nic_in
        self.nvl_in += other.nvl_in
        self.staged |= other.staged
        self.direct = self.direct or other.direct
        self.buckets += other.buckets
        self.peers |= other.peers

    def traffic(self) -> RankTraffic:
        t = RankTraffic(self.rank)
        t.ports[0]["nic_in"], t.ports[0]["nvl_in"] = self.nic_in, self.nvl_in
        t.rounds[0] = len(self.staged) + (1 if self.direct else 0)
        t.buckets[0] = self.buckets
        t.peers = len(self.peers)
        return t


@dataclass
class Phase:
    name: str
    start: float
    seconds: float
    bandwidth_seconds: float
    latency_seconds: float
    bottleneck_rank: int | None
    bottleneck_port: str | None


@dataclass
class SimResult:
    seconds: float
    phases: list[Phase]
    topology: Topology
    # per rank: [(phase, start, seconds busy)] for drawing a timeline
    timeline: dict[int, list[tuple[int, float, float]]]
    overlapped_seconds: float = 0.0  # phases overlapped (forward each stripe as it lands)

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "overlapped_seconds": self.overlapped_seconds,
            "phases": [{"name": p.name, "start_s": p.start, "seconds": p.seconds,
                        "bandwidth_seconds": p.bandwidth_seconds, "latency_seconds": p.latency_seconds,
                        "bottleneck_rank": p.bottleneck_rank, "bottleneck_port": p.bottleneck_port}
                       for p in self.phases],
        }


PHASE_NAMES = ("sources -> destinations", "all-gather in replica groups")


def simulate(traffic: Iterable[RankTraffic], topo: Topology) -> SimResult:
    """Simulated refit time of a whole fleet's plans (see the module docstring for the model)."""
    traffic = list(traffic)
    phases: list[Phase] = []
    timeline: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    start = 0.0
    lat = topo.latency_us * 1e-6
    for ph, name in enumerate(PHASE_NAMES):
        if not any(t.buckets[ph] for t in traffic):
            continue
        worst, worst_rank, worst_port = 0.0, None, None
        for t in traffic:
            msgs = t.buckets[ph] * topo.message_us * 1e-6
            for p in PORTS:
                s = t.ports[ph][p] / topo.bandwidth(p) + msgs
                if s > worst:
                    worst, worst_rank, worst_port = s, t.rank, p
        rounds = max(t.rounds[ph] for t in traffic)
        seconds = worst + lat * rounds
        for t in traffic:
            if t.buckets[ph]:
                timeline[t.rank].append((ph, start, t.busy(ph, topo) + lat * t.rounds[ph]))
        phases.append(Phase(name, start, seconds, worst, lat * rounds, worst_rank, worst_port))
        start += seconds
    # what forwarding each stripe as soon as it lands would give: every port carries both
    # phases' bytes at once (refit.transport.fanout runs the phases one after the other today)
    msg = topo.message_us * 1e-6
    overlapped = max((sum(t.ports[ph][p] for ph in range(2)) / topo.bandwidth(p) + msg * sum(t.buckets)
                      for t in traffic for p in PORTS), default=0.0) + lat * max((sum(t.rounds) for t in traffic),
                                                                                 default=0)
    return SimResult(start, phases, topo, dict(timeline), overlapped)


# -- the lower bound -------------------------------------------------------------------------------

@dataclass
class Bound:
    """A bandwidth lower bound: ``seconds``, what binds it, and its parts."""

    seconds: float
    relay: bool
    binding: str
    parts: dict[str, float]
    per_rank_in: dict[int, int]  # bytes each destination rank must receive
    owed_bytes: int  # bytes the sources must send in all
    max_share_bytes: int = 0  # the most bytes one source rank must send (its replica set's share)

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "relay": self.relay, "binding": self.binding, "parts": self.parts,
                "source_bytes": self.owed_bytes, "max_rank_ingress_bytes": max(self.per_rank_in.values(), default=0),
                "max_rank_egress_bytes": self.max_share_bytes}


def lower_bound(index: ParamIndex, topo: Topology, *, relay: bool = False) -> Bound:
    """The bandwidth lower bound of the layouts in ``index`` on ``topo`` (module docstring).

    ``relay=False``: every destination rank gets its bytes from a source (a plan without
    fan-out). ``relay=True``: destinations may forward to each other (fan-out), so the
    sources owe one copy per element and a node's NICs can share its ingress.
    Params sharing a shape and layouts are computed once.
    """
    region = GeometryCache().region
    node = topo.node
    need: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # destination rank -> bytes by link
    owed: dict[frozenset, list[int]] = defaultdict(lambda: [0, 0, 0])  # replica set -> bytes by link
    node_need: dict[int, int] = defaultdict(int)
    groups: dict[tuple, int] = defaultdict(int)
    for spec in index.specs.values():
        groups[(spec.shape, spec.src, spec.dsts)] += 1
    total_owed = 0
    for (shape, src, dsts), count in groups.items():
        total_owed += _add_group(shape, src, dsts, count, node=node, region=region, relay=relay, need=need,
                                 owed=owed, node_need=node_need)
    parts: dict[str, float] = {}
    binding_of: dict[str, str] = {}

    def consider(part: str, seconds: float, what: str) -> None:
        if seconds > parts.get(part, -1.0):
            parts[part] = seconds
            binding_of[part] = what

    nic_in, nvl_in = topo.bandwidth("nic_in"), topo.bandwidth("nvl_in")
    for r, by_link in need.items():
        # relayed bytes may come from any rank, so over either link
        seconds, links = fastest_split([0, 0, sum(by_link)] if relay else by_link, nic_in, nvl_in)
        consider("ingress", seconds, f"rank {r} receives over {links}")
    if relay:
        gpus: dict[int, int] = defaultdict(int)
        for r in range(index.world_size):
            gpus[node(r)] += 1
        for n_, b in node_need.items():
            consider("node_ingress", b / (gpus[n_] * topo.bandwidth("nic_in")), f"node {n_} NICs")
    sets = list(owed)
    max_share = 0
    for u in sets:
        tot = [sum(owed[v][link] for v in sets if v <= u) for link in (NIC, NVL, EITHER)]
        size = len(u)
        max_share = max(max_share, -(-sum(tot) // size))
        who = f"ranks {sorted(u)}" if size <= 4 else f"{size} ranks {min(u)}..{max(u)}"
        seconds, _ = fastest_split([b / size for b in tot], topo.bandwidth("nic_out"), topo.bandwidth("nvl_out"))
        consider("egress", seconds, f"{who} send what only they hold")
    binding = max(parts, key=parts.get) if parts else "none"
    per_rank_in = {r: sum(by_link) for r, by_link in need.items()}
    return Bound(max(parts.values(), default=0.0), relay, f"{binding}: {binding_of.get(binding, '')}", parts,
                 per_rank_in, total_owed, max_share)


def _add_group(shape, src, dsts, count: int, *, node, region, relay: bool, need: dict, owed: dict,
               node_need: dict) -> int:
    """Add ``count`` params of one shape and layouts to what every destination rank needs (``need``),
    what every replica set of sources owes (``owed``) and, relayed, what every node's NICs bring
    in (``node_need``); the bytes its sources owe."""
    total_owed = 0
    src_nodes = {node(r) for r in src.mesh_ranks}
    items = [itemsize(wire_dtype(src.dtype, lay.dtype)) for lay in dsts]
    shards = {}  # source shard key -> (its holders, their nodes, its region)
    for r0 in src.mesh_ranks:
        key = src.shard_key(r0)
        if key not in shards:
            reps = src.replicas(key)
            shards[key] = (reps, {node(r) for r in reps}, region(shape, src, reps[0]))
    # what every destination rank must receive, and over which of its links
    for g, lay in enumerate(dsts):
        for r in lay.mesh_ranks:
            reg = region(shape, lay, r)
            if node(r) not in src_nodes:  # no holder on its node: all over its NIC
                received = [(NIC, region_numel(reg))]
            else:
                received = [(link_between(rep_nodes, node(r)), region_overlap_numel(reg, sreg))
                            for reps, rep_nodes, sreg in shards.values() if r not in reps]
            for link, n in received:
                if n:
                    need[r][link] += n * items[g] * count
    if relay:
        # a node's NICs bring in, once, each element its ranks need (one layout's distinct shards)
        per_node: dict[int, list[int]] = defaultdict(lambda layouts=dsts: [0] * len(layouts))
        for g, lay in enumerate(dsts):
            seen = set()
            for r in lay.mesh_ranks:
                n_ = node(r)
                if n_ in src_nodes or src.coords(r) is not None:
                    continue
                key = (n_, lay.shard_key(r))
                if key not in seen:
                    seen.add(key)
                    per_node[n_][g] += region_numel(region(shape, lay, r)) * items[g]
        for n_, per_g in per_node.items():
            node_need[n_] += max(per_g) * count
    # what the holders of every source shard owe
    dst_ranks = [(g, r) for g, lay in enumerate(dsts) for r in lay.mesh_ranks]
    for reps, rep_nodes, sreg in shards.values():
        by_layout = [[0, 0, 0] for _ in dsts]  # per layout: bytes by link needed by non-holders
        if any(node(r) in rep_nodes for _, r in dst_ranks):
            for g, r in dst_ranks:
                if r not in reps:
                    n = region_overlap_numel(sreg, region(shape, dsts[g], r)) * items[g]
                    by_layout[g][link_between(rep_nodes, node(r))] += n
        else:  # disaggregated: every layout needs the whole shard, replication times, over NICs
            for g, lay in enumerate(dsts):
                by_layout[g][NIC] = region_numel(sreg) * lay.replication * items[g]
        if relay:  # one copy of each element: a layout's bytes over its replication
            pick = max(range(len(dsts)), key=lambda g: sum(by_layout[g]) / dsts[g].replication, default=None)
            if pick is None:
                continue
            by_link = [-(-b // dsts[pick].replication) for b in by_layout[pick]]
        else:
            by_link = [sum(b[link] for b in by_layout) for link in (NIC, NVL, EITHER)]
        slot = owed[frozenset(reps)]
        for link, b in enumerate(by_link):
            slot[link] += b * count
        total_owed += sum(by_link) * count
    return total_owed


def balance(values: Sequence[int]) -> dict:
    """Heaviest value against the ideal (the mean) of a set of per-rank loads."""
    vals = [v for v in values]
    if not vals:
        return {"max": 0, "ideal": 0, "ratio": 1.0, "ranks": 0}
    ideal = sum(vals) / len(vals)
    mx = max(vals)
    return {"max": mx, "ideal": ideal, "ratio": (mx / ideal) if ideal else 1.0, "ranks": len(vals)}


__all__ = ["CONNECTIONS", "NCCL", "NIXL", "Bound", "Connections", "Phase", "RankTraffic", "SimResult", "Topology",
           "Receipts", "balance", "connection_costs", "delta_wire_bytes", "lower_bound", "simulate", "traffic_of"]
