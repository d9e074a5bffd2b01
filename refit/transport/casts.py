"""Source values that do not fit their destination's dtype: found per param, reported or refused.

A narrowing cast rounds (``refit.plan.casts`` refuses the ones that do worse), but a value
beyond the destination's range does not round: fp32 70000 lands in fp16 as inf, 500 lands in
``float8_e4m3fn`` as NaN, int32 -1 wraps to 255 in uint8. torch's ``.to()`` says nothing, and
neither would the engine until it served the result. So each source rank holds its values
to the range of every destination dtype that could be too small, once per transfer (one
reduction per such param and one host copy of all the results), and the overflows are reported
per param: a ``CastOverflowWarning`` and the transfer's ``cast_overflows``, or, with
``strict_casts``, a ``PlanError`` on every rank before any byte moves.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from refit.comm.wire import register_record
from refit.errors import CastOverflowWarning, PlanError
from refit.layout import dtype_from_name
from refit.plan.casts import value_check_needed

__all__ = ["CastOverflow", "find_overflows", "narrowing_casts", "raise_or_warn", "value_range"]


@dataclass(frozen=True)
class CastOverflow:
    """A param whose finite source values on ``rank`` reach beyond its ``dst_dtype`` destination's range."""

    param: str
    rank: int
    src_dtype: str
    dst_dtype: str
    low: float  # the source's smallest and largest finite values on this rank
    high: float

    def __str__(self) -> str:
        dst = dtype_from_name(self.dst_dtype)
        if dst.is_floating_point:
            limit = f"largest finite value {float(torch.finfo(dst).max):g}; beyond it lands as inf, NaN or clamped"
        else:
            info = torch.iinfo(dst)
            limit = f"range [{info.min}, {info.max}]; outside it wraps"
        held = (f"magnitudes up to {self.high:g}" if dtype_from_name(self.src_dtype).is_floating_point
                else f"values in [{self.low:g}, {self.high:g}]")
        return (f"{self.param}: rank {self.rank}'s {self.src_dtype} source holds {held}, beyond the "
                f"{self.dst_dtype} destination's {limit}")


register_record(CastOverflow)


def narrowing_casts(index, rank: int, names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The params of ``names`` that ``rank`` sources whose values must be held to some destination's
    range, with those destination dtypes (from the merged index, so every source rank agrees)."""
    out = {}
    for name in names:
        spec = index.specs.get(name)
        if spec is None or spec.src.coords(rank) is None:
            continue
        narrow = tuple(sorted({d.dtype for d in spec.dsts if value_check_needed(spec.src.dtype, d.dtype)}))
        if narrow:
            out[name] = narrow
    return out


def _bounds(t: torch.Tensor) -> torch.Tensor:
    """``[low, high]`` of ``t`` as float64 on its device; for floats ``[-max |x|, max |x|]`` (NaN
    or inf when ``t`` holds some: the finite ones are then found apart)."""
    if t.is_floating_point():
        top = torch.linalg.vector_norm(t, ord=math.inf).to(torch.float64)
        return torch.stack([-top, top])
    lo, hi = torch.aminmax(t)
    return torch.stack([lo, hi]).to(torch.float64)


def value_range(t: torch.Tensor) -> tuple[float, float] | None:
    """The smallest and largest finite values of ``t`` (floats: minus and plus the largest magnitude);
    None for an empty tensor or one without a finite value."""
    ranges = _ranges({"t": t})
    return ranges.get("t")


def _ranges(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    names = [n for n, t in tensors.items() if t.numel() and not t.is_complex() and t.dtype != torch.bool]
    if not names:
        return {}
    got = torch.stack([_bounds(tensors[n]) for n in names]).cpu().tolist()  # one host copy for them all
    out = {}
    for n, (lo, hi) in zip(names, got):
        if not (math.isfinite(lo) and math.isfinite(hi)):  # an inf or a NaN in the source: not a cast's doing
            finite = tensors[n][torch.isfinite(tensors[n])]
            if not finite.numel():
                continue
            top = float(finite.abs().max())
            lo, hi = -top, top
        out[n] = (lo, hi)
    return out


def overflow_threshold(dst: torch.dtype) -> float:
    """The smallest magnitude that does not round to a finite ``dst`` value: its largest finite value
    plus half a step of its top binade. Computed, not cast: some casts (to ``float8_e4m3fn``)
    saturate at the largest value instead of overflowing, and a clamp is no rounding either."""
    info = torch.finfo(dst)
    top = float(info.max)
    return top + float(info.eps) * 2.0 ** math.floor(math.log2(top)) / 2


def fits(low: float, high: float, dst_dtype: str) -> bool:
    """Whether every value in ``[low, high]`` stays finite (a float) or unwrapped (an integer) in ``dst_dtype``."""
    dst = dtype_from_name(dst_dtype)
    if dst.is_floating_point:
        return max(abs(low), abs(high)) < overflow_threshold(dst)
    info = torch.iinfo(dst)
    return info.min <= low and high <= info.max


def find_overflows(checks: Mapping[str, Sequence[str]], src: Mapping[str, torch.Tensor], rank: int,
                   src_dtypes: Mapping[str, str] | None = None) -> list[CastOverflow]:
    """Every (param, destination dtype) of ``checks`` (``narrowing_casts``) whose source values on
    this rank do not fit; ``src`` holds this rank's local source tensors."""
    tensors = {n: src[n] for n in checks if n in src}
    out = []
    for name, (lo, hi) in sorted(_ranges(tensors).items()):
        src_dtype = (src_dtypes or {}).get(name) or str(tensors[name].dtype).removeprefix("torch.")
        out += [CastOverflow(name, rank, src_dtype, d, lo, hi) for d in checks[name] if not fits(lo, hi, d)]
    return out


def raise_or_warn(overflows: Sequence[CastOverflow], strict: bool, *, warn: bool = True) -> None:
    """``strict``: raise ``PlanError`` naming every overflow (the same on every rank that has the
    same list); otherwise one ``CastOverflowWarning`` per overflow when ``warn``."""
    if not overflows:
        return
    if strict:
        raise PlanError("strict_casts: source values do not fit their destination dtype: "
                        + "; ".join(str(o) for o in overflows))
    if warn:
        for o in overflows:
            warnings.warn(str(o), CastOverflowWarning, stacklevel=3)
