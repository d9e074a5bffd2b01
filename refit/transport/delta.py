"""A bucket as the words that changed since the version its receiver holds: the arithmetic of a delta refit.

At RL learning rates most bf16 weights do not change in a step (an element's export moves only
when its fp32 master crosses a rounding boundary; the README measures 1.5% to 10% per step). A
sender that kept the bytes it sent last time compares them word by word with this step's and
sends only the words that differ, in whichever of three forms is smallest:

* ``DENSE``: every word (nothing is saved, nothing is paid);
* ``BITMASK``: one bit per word (padded to 4 bytes), then the changed words' values (``n/8 + k*w`` bytes);
* ``INDICES``: the changed words' positions as int32, then their values (``4k + k*w`` bytes).

For bf16 words (``w = 2``) indices win below 3.1% changed, the bitmask above, and dense only
above 94%. A word is the bucket's smallest element (1, 2 or 4 bytes), compared as raw bits, so
a NaN equals itself and ``-0.0`` differs from ``0.0``: applying a delta to the base it was
taken against gives back the new bytes exactly, whatever they hold. Everything here is pure
tensor arithmetic, on whatever device the buffers live: no process group, no peer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from refit.errors import PlanError

__all__ = ["DeltaFormat", "DeltaHeader", "apply_delta", "choose_format", "encode_delta", "encoded_bytes", "mask_bytes"]

INDEX_BYTES = 4  # a changed word's position: int32, so a delta addresses up to 2**31 words of a bucket
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class DeltaFormat(enum.IntEnum):
    DENSE = 0
    BITMASK = 1
    INDICES = 2


@dataclass(frozen=True)
class DeltaHeader:
    """What a receiver needs to apply a payload: its form, the bucket's words and their width, and
    how many changed."""

    format: DeltaFormat
    words: int
    word_bytes: int
    changed: int

    @property
    def payload_bytes(self) -> int:
        return encoded_bytes(self.format, self.words, self.word_bytes, self.changed)


def encoded_bytes(fmt: DeltaFormat, words: int, word_bytes: int, changed: int) -> int:
    """The payload's size in ``fmt`` for a bucket of ``words`` words of ``word_bytes``, ``changed`` of them new."""
    if fmt is DeltaFormat.DENSE:
        return words * word_bytes
    if fmt is DeltaFormat.BITMASK:
        return mask_bytes(words) + changed * word_bytes
    return changed * (INDEX_BYTES + word_bytes)


def mask_bytes(words: int) -> int:
    """A bitmask's bytes: a bit per word, padded to whole 4-byte words so that the values after it
    are aligned for any word width."""
    return -(-words // 32) * 4


def choose_format(words: int, word_bytes: int, changed: int) -> DeltaFormat:
    """The smallest form; on a tie the simpler one (dense, then bitmask)."""
    return min(DeltaFormat, key=lambda f: (encoded_bytes(f, words, word_bytes, changed), f))


def _as_words(buf: torch.Tensor, word_bytes: int, what: str) -> torch.Tensor:
    if word_bytes not in _WORDS:
        raise PlanError(f"a delta's word is 1, 2 or 4 bytes, got {word_bytes}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise PlanError(f"{what}: a delta reads a contiguous 1-d uint8 buffer, got {buf.dtype} {tuple(buf.shape)}")
    if buf.numel() % word_bytes:
        raise PlanError(f"{what}: {buf.numel()} bytes are not whole words of {word_bytes} bytes")
    return buf.view(_WORDS[word_bytes])


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    pad = mask_bytes(mask.numel()) * 8 - mask.numel()
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, words: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:words].bool()


def encode_delta(new: torch.Tensor, base: torch.Tensor, word_bytes: int,
                 fmt: DeltaFormat | None = None) -> tuple[DeltaHeader, torch.Tensor]:
    """``new`` as a change of ``base`` (both the bucket's bytes, the same size): the header and the
    payload, in the smallest form unless ``fmt`` names one."""
    new_w, base_w = _as_words(new, word_bytes, "new"), _as_words(base, word_bytes, "base")
    if new_w.numel() != base_w.numel():
        raise PlanError(f"a delta needs its base to be the bucket's size: new has {new.numel()} bytes, base "
                        f"{base.numel()}")
    mask = new_w != base_w
    changed = int(mask.sum())
    words = new_w.numel()
    fmt = choose_format(words, word_bytes, changed) if fmt is None else DeltaFormat(fmt)
    header = DeltaHeader(fmt, words, word_bytes, changed)
    if fmt is DeltaFormat.DENSE:
        return header, new.clone()
    values = new_w[mask].view(torch.uint8)
    if fmt is DeltaFormat.BITMASK:
        return header, torch.cat([_pack_bits(mask), values])
    index = mask.nonzero().view(-1).to(torch.int32).view(torch.uint8)
    return header, torch.cat([index, values])


def apply_delta(header: DeltaHeader, payload: torch.Tensor, base: torch.Tensor) -> None:
    """Turn ``base`` (the version the delta was taken against) into the new bytes, in place."""
    base_w = _as_words(base, header.word_bytes, "base")
    if base_w.numel() != header.words:
        raise PlanError(f"a delta of {header.words} words of {header.word_bytes} bytes cannot apply to a base of "
                        f"{base.numel()} bytes")
    if payload.dtype != torch.uint8 or payload.numel() != header.payload_bytes:
        raise PlanError(f"a {header.format.name} delta of {header.changed} changed words carries "
                        f"{header.payload_bytes} bytes, got {payload.numel()} ({payload.dtype})")
    if header.format is DeltaFormat.DENSE:
        base.copy_(payload)
        return
    word = _WORDS[header.word_bytes]
    if header.format is DeltaFormat.BITMASK:
        head = mask_bytes(header.words)
        mask = _unpack_bits(payload[:head], header.words)
        if int(mask.sum()) != header.changed:
            raise PlanError(f"a bitmask delta says {header.changed} words changed, its mask marks {int(mask.sum())}")
        base_w[mask] = payload[head:].view(word)
        return
    head = header.changed * INDEX_BYTES
    index = payload[:head].view(torch.int32).long()
    if header.changed and (int(index.min()) < 0 or int(index.max()) >= header.words):
        raise PlanError(f"an index delta addresses words outside the bucket's {header.words}")
    base_w[index] = payload[head:].view(word)
