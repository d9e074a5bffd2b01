"""What a vLLM worker computes with after a refit: every layer's own kernels, checked against the verified shards.

Bytes that arrived and checksummed are not yet weights being served. vLLM's CPU build
packs each linear layer's weight into a copy of its own (oneDNN or sgl-kernel layouts) that
only that layer's post-load processing rebuilds, and drops the parameter itself; an output
head tied to the embedding holds the embedding's parameter but loads nothing, so a reload
that re-processes only the layers it loaded leaves the head computing with the copy it
packed at start-up: right bytes, stale logits, and every checksum agreeing.

Two things close that gap, both read off the engine's own module graph:

* ``reprocess_sharing_layers``: after a load, every layer that holds a parameter (by
  identity or storage) that the load wrote, but was not itself loaded, re-runs its
  ``quant_method.process_weights_after_loading``, so its private copies are rebuilt too;
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

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from refit.engines.vllm.destinations import Destination
from refit.errors import RefitError
from refit.layout import mesh_coords_of, shard_slices

__all__ = ["LayerMismatch", "ServedReport", "ServedWeightsMismatch", "check_served", "reprocess_sharing_layers"]

PROBE_COLUMNS = 8
EXPERT_PROBE_TOKENS = 2
# the rounding an expert's two matmuls and activation may differ by, relative to the sum of |terms|
_EXPERT_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 4e-3}


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
                "unchecked": list(self.unchecked), "seconds": self.seconds}


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


def _probe_columns(width: int, salt: int) -> list[int]:
    """First, last and a few columns that move from refit to refit (a permuted column shows in time)."""
    gen = np.random.default_rng(salt)
    picks = {0, width - 1, *gen.integers(0, width, size=max(0, PROBE_COLUMNS - 2)).tolist()}
    return sorted(picks)


def _first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    bad = int((diff > 0).sum()) if diff.numel() else 0
    worst = float(diff.max()) if diff.numel() else 0.0
    return f"{bad} of {expected.numel()} probed values differ (max |diff| {worst:.3g})"


class _Checker:
    def __init__(self, model: torch.nn.Module, destinations: Sequence[Destination],
                 received: Mapping[str, torch.Tensor], tp_rank: int, salt: int):
        self.model, self.received, self.tp_rank, self.salt = model, received, tp_rank, salt
        params = dict(model.named_parameters(remove_duplicate=False))
        self.by_param: dict[int, list[Destination]] = defaultdict(list)
        for d in destinations:
            if d.target in params and d.name in received:
                self.by_param[id(params[d.target])].append(d)
        self.report = ServedReport()

    def run(self) -> ServedReport:
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, module in _holders(self.model):
                held = {attr: self.by_param[id(p)] for attr, p in module._parameters.items()
                        if p is not None and id(p) in self.by_param}
                if held:
                    self._layer(name, module, held)
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def _fail(self, layer: str, kind: str, d: Destination, detail: str) -> None:
        self.report.mismatches.append(LayerMismatch(layer, kind, d.name, detail))

    def _layer(self, name: str, module: torch.nn.Module, held: dict[str, list[Destination]]) -> None:
        kinds = _classes(module)
        method = getattr(module, "quant_method", None)
        unquantized = method is None or type(method).__name__.startswith("Unquantized")
        if method is not None and not unquantized:
            self.report.unchecked.append(f"{name} ({type(method).__name__})")
            return
        self.report.checked += 1
        if "RoutedExperts" in kinds:
            self._experts(name, module, held)
            return
        for attr, ds in held.items():
            for d in ds:
                if "ParallelLMHead" in kinds or ("LinearBase" in kinds and attr == "weight"):
                    self._linear_weight(name, module, d, "output head" if "ParallelLMHead" in kinds else "linear")
                elif "LinearBase" in kinds and attr == "bias":
                    self._linear_bias(name, module, d)
                elif "VocabParallelEmbedding" in kinds and attr == "weight":
                    self._embedding(name, module, d)
                else:
                    self._parameter(name, module, attr, d)

    def _linear_weight(self, name: str, module: torch.nn.Module, d: Destination, kind: str) -> None:
        rows = _row_map(module, d, self.tp_rank)
        if rows is None:
            return
        live_rows, buf_rows = rows
        buf = self.received[d.name][buf_rows]
        cols = _probe_columns(buf.shape[1], self.salt + len(self.report.mismatches) + live_rows.start)
        probe = torch.zeros(len(cols), buf.shape[1], dtype=d.dtype, device=buf.device)
        probe[torch.arange(len(cols)), torch.tensor(cols)] = 1
        out = module.quant_method.apply(module, probe.to(self._device(module)))
        actual = out[:, live_rows].to(buf.device)
        expected = buf[:, cols].t()
        if actual.shape != expected.shape:
            self._fail(name, kind, d, f"its kernel gives {list(actual.shape)} outputs for rows "
                                      f"{live_rows.start}:{live_rows.stop}, the shard has {list(expected.shape)}")
        elif not torch.equal(actual.to(expected.dtype), expected):
            self._fail(name, kind, d, f"rows {live_rows.start}:{live_rows.stop}: {_first_difference(actual, expected)}")

    def _linear_bias(self, name: str, module: torch.nn.Module, d: Destination) -> None:
        live_rows, buf_rows = _row_map(module, d, self.tp_rank)
        bias = getattr(module, "bias", None)
        width = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
        expected = self.received[d.name][buf_rows]
        zero = torch.zeros(1, int(width), dtype=d.dtype, device=self._device(module))
        out = module.quant_method.apply(module, zero, bias)[0, live_rows].to(expected.device)
        if not torch.equal(out.to(expected.dtype), expected):
            self._fail(name, "linear bias", d, f"rows {live_rows.start}:{live_rows.stop}: "
                                               f"{_first_difference(out, expected)}")

    def _embedding(self, name: str, module: torch.nn.Module, d: Destination) -> None:
        rows = _row_map(module, d, self.tp_rank)
        if rows is None:
            return
        live_rows, buf_rows = rows
        buf = self.received[d.name][buf_rows]
        picks = _probe_columns(buf.shape[0], self.salt)
        ids = torch.tensor([live_rows.start + i for i in picks], device=self._device(module))
        actual = module.quant_method.embedding(module, ids).to(buf.device)
        expected = buf[picks]
        if not torch.equal(actual.to(expected.dtype), expected):
            self._fail(name, "embedding", d, f"rows {picks}: {_first_difference(actual, expected)}")

    def _parameter(self, name: str, module: torch.nn.Module, attr: str, d: Destination) -> None:
        live = getattr(module, attr).data
        if d.expert is not None:
            live = live[d.expert]
        lo, hi = d.rows
        live = live[lo:hi] if live.dim() else live
        expected = self.received[d.name]
        if live.shape != expected.shape or not torch.equal(live.to(expected.device), expected):
            self._fail(name, "parameter", d, f"{attr}: " + (
                f"live shape {list(live.shape)}, shard {list(expected.shape)}" if live.shape != expected.shape
                else _first_difference(live.to(expected.device), expected)))

    def _experts(self, name: str, module: torch.nn.Module, held: dict[str, list[Destination]]) -> None:
        """Each expert this worker holds, through the layer's fused-experts kernel, tokens routed to it alone."""
        parts: dict[int, dict[str, Destination]] = defaultdict(dict)
        for attr, ds in held.items():
            for d in ds:
                role = "down" if attr.startswith("w2") else ("gate" if d.rows[0] == 0 else "up")
                parts[d.expert][role] = d
        if getattr(module, "activation", None) is not None and "silu" not in str(module.activation).lower():
            self.report.unchecked.append(f"{name} (activation {module.activation})")
            return
        slots = sorted(e for e, p in parts.items() if len(p) == 3)
        if not slots:
            return
        global_of = self._global_experts(module)
        first = parts[slots[0]]["gate"]
        hidden = first.local_shape[1]
        dtype, device = first.dtype, self._device(module)
        gen = torch.Generator().manual_seed(self.salt)
        x = torch.randn(len(slots) * EXPERT_PROBE_TOKENS, hidden, generator=gen).to(dtype)
        top_k = int(getattr(module, "top_k", 1) or 1)
        ids = torch.tensor([global_of[e] for e in slots for _ in range(EXPERT_PROBE_TOKENS)], dtype=torch.int32)
        topk_ids = ids[:, None].expand(-1, top_k).contiguous()
        topk_weights = torch.zeros(len(ids), top_k, dtype=torch.float32)
        topk_weights[:, 0] = 1
        out = module.quant_method.apply(module, x.to(device), topk_weights.to(device), topk_ids.to(device),
                                        None, None)
        out = (out[0] if isinstance(out, tuple) else out).double().cpu()
        rtol = _EXPERT_RTOL.get(dtype, 1e-4)
        for i, e in enumerate(slots):
            p = parts[e]
            w_gate, w_up, w_down = (self.received[p[r].name].double().cpu() for r in ("gate", "up", "down"))
            xs = x[i * EXPERT_PROBE_TOKENS:(i + 1) * EXPERT_PROBE_TOKENS].double()
            g, u = xs @ w_gate.t(), xs @ w_up.t()
            h = torch.nn.functional.silu(g) * u
            expected = h @ w_down.t()
            # first-order size of every rounding: the two input matmuls, the activation, the last matmul
            # (silu's slope stays below 1.1)
            spread = (h.abs() + 1.1 * (xs.abs() @ w_gate.abs().t()) * u.abs()
                      + torch.nn.functional.silu(g).abs() * (xs.abs() @ w_up.abs().t()))
            scale = spread @ w_down.abs().t()
            got = out[i * EXPERT_PROBE_TOKENS:(i + 1) * EXPERT_PROBE_TOKENS]
            err = (got - expected).abs()
            if got.shape != expected.shape or bool((err > rtol * scale + 1e-30).any()):
                self._fail(name, "experts", p["gate"], f"expert slot {e} (global {global_of[e]}): max |diff| "
                                                       f"{float(err.max()):.3g}, beyond rounding ({rtol:g} relative)")

    @staticmethod
    def _global_experts(module: torch.nn.Module) -> dict[int, int]:
        """Local expert slot -> global expert id, through the layer's expert map when it has one."""
        expert_map = getattr(module, "expert_map", None)
        if expert_map is None:
            return {e: e for e in range(int(module.local_num_experts))}
        return {int(local): g for g, local in enumerate(expert_map.tolist()) if local >= 0}

    @staticmethod
    def _device(module: torch.nn.Module) -> torch.device:
        for p in module.parameters():
            return p.device
        return torch.device("cpu")


def check_served(model: torch.nn.Module, destinations: Sequence[Destination], received: Mapping[str, torch.Tensor],
                 *, tp_rank: int, salt: int = 0) -> ServedReport:
    """Run every layer that holds a received parameter through its own kernel; what disagrees with the shard.

    ``received`` holds each destination's verified shard by checkpoint name (loader mode's
    side buffers, or direct mode's live views). ``salt`` varies the probed columns from one
    refit to the next.
    """
    return _Checker(model, destinations, received, tp_rank, salt).run()
