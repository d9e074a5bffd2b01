"""Which source-to-destination casts a transfer may make.

A destination whose dtype differs from its source's gets the source cast on the way
(``copy_``, as torch's ``.to()``). torch casts anything to anything without a word: a
complex source loses its imaginary part in a real destination, a float source is truncated
and wraps in an integer one (300.7 lands in an int8 as 44), and an integer source keeps
only zero or not in a bool. None of these is a rounding, and none shows up until the
engine serves garbage, so such a destination is refused by name before any byte moves.

Narrowing within a kind (fp32 to bf16 or fp16, int64 to int32) rounds, and is allowed,
but its range can be too small for the values: ``value_check_needed`` says when a source's
values must be held to the destination's range (``refit.transport.casts`` does, per transfer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit.errors import PlanError
from refit.layout import dtype_from_name

__all__ = ["cast_refusal", "check_casts", "value_check_needed"]

_KINDS = ("bool", "integer", "floating point", "complex")


def _kind(dt: torch.dtype) -> int:
    if dt == torch.bool:
        return 0
    if dt.is_complex:
        return 3
    if dt.is_floating_point:
        return 2
    return 1


def cast_refusal(src: str, dst: str) -> str | None:
    """Why a ``src`` source cannot land in a ``dst`` destination (None: it can).

    Refused: any cast to a lower kind (complex > floating point > integer > bool), since it
    drops information that no rounding accounts for.
    """
    if src == dst:
        return None
    s, d = _kind(dtype_from_name(src)), _kind(dtype_from_name(dst))
    if d >= s:
        return None
    if s == 3:
        return "complex to real drops the imaginary part"
    if s == 2 and d == 1:
        return "floating point to integer truncates the fraction and wraps what does not fit"
    return f"{_KINDS[s]} to bool keeps only zero or not"


def _range(dt: torch.dtype) -> float:
    return float(torch.finfo(dt).max) if dt.is_floating_point else float(torch.iinfo(dt).max)


def value_check_needed(src: str, dst: str) -> bool:
    """Whether some finite ``src`` values do not fit in ``dst`` (they would become inf or NaN in a
    float, or wrap in an integer): a narrower float (fp32 to fp16, bf16 or FP8), an integer into a
    float of smaller range (int32 to fp16) or into a narrower or unsigned integer."""
    if src == dst:
        return False
    s, d = dtype_from_name(src), dtype_from_name(dst)
    if s == torch.bool or s.is_complex or d.is_complex or d == torch.bool or cast_refusal(src, dst):
        return False
    if not d.is_floating_point:  # integer to integer: the range, or the sign
        si, di = torch.iinfo(s), torch.iinfo(d)
        return di.max < si.max or di.min > si.min
    return _range(d) < _range(s)


def check_casts(names: Sequence[str], src_dtype: str, src_ranks: Sequence[int],
                dsts: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Raise ``PlanError`` naming the params, the dtypes and the ranks when a destination
    (``(dtype, ranks)`` each) would get a lossy cast of the source (``cast_refusal``)."""
    for dst_dtype, dst_ranks in dsts:
        why = cast_refusal(src_dtype, dst_dtype)
        if why is None:
            continue
        shown = ", ".join(sorted(names)[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")
        raise PlanError(f"{shown}: the source is {src_dtype} on rank(s) {sorted(src_ranks)} but the destination "
                        f"is {dst_dtype} on rank(s) {sorted(dst_ranks)}: {why}; refit casts only within a kind "
                        "of dtype or to a wider one (give the destination a floating point dtype, or cast the "
                        "source yourself)")
