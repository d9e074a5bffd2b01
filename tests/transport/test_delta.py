"""A delta of a bucket against the version its receiver holds: exact, and never larger than it must be."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refit.errors import PlanError
from refit.transport.delta import (
    DeltaFormat,
    DeltaHeader,
    apply_delta,
    choose_format,
    encode_delta,
    encoded_bytes,
)

WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@st.composite
def versions(draw):
    """A base bucket and a new one in which some words changed (a word rewritten with its own value
    does not count as changed)."""
    word_bytes = draw(st.sampled_from([1, 2, 4]))
    words = draw(st.integers(0, 700))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (words * word_bytes,), dtype=torch.uint8, generator=g)
    new = base.clone()
    fraction = draw(st.sampled_from([0.0, 0.001, 0.02, 0.05, 0.3, 0.97, 1.0]))
    if words:
        hit = torch.rand(words, generator=g) < fraction
        view = new.view(WORD[word_bytes])
        fresh = torch.randint(0, 256, (words * word_bytes,), dtype=torch.uint8, generator=g).view(WORD[word_bytes])
        view[hit] = fresh[hit]
    return word_bytes, base, new


@settings(max_examples=300, deadline=None)
@given(versions())
def test_a_delta_applied_to_its_base_gives_the_new_bytes_and_is_the_smallest_form(case):
    word_bytes, base, new = case
    header, payload = encode_delta(new, base, word_bytes)
    words = base.numel() // word_bytes
    changed = int((new.view(WORD[word_bytes]) != base.view(WORD[word_bytes])).sum()) if words else 0
    assert (header.words, header.word_bytes, header.changed) == (words, word_bytes, changed)
    assert payload.dtype == torch.uint8 and payload.numel() == header.payload_bytes
    sizes = {f: encoded_bytes(f, words, word_bytes, changed) for f in DeltaFormat}
    assert header.payload_bytes == min(sizes.values()) and header.format == choose_format(words, word_bytes, changed)
    target = base.clone()
    apply_delta(header, payload, target)
    assert torch.equal(target, new)
    for fmt in DeltaFormat:  # every form is exact, not only the one chosen
        forced, forced_payload = encode_delta(new, base, word_bytes, fmt)
        assert forced.format is fmt and forced_payload.numel() == sizes[fmt]
        target = base.clone()
        apply_delta(forced, forced_payload, target)
        assert torch.equal(target, new)


def test_words_are_compared_as_bits_so_nans_and_signed_zeros_round_trip():
    base = torch.tensor([0.0, float("nan"), 1.0, -0.0, 2.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0, 0.0, float("inf")], dtype=torch.bfloat16)
    b, n = base.view(torch.uint8), new.view(torch.uint8)
    header, payload = encode_delta(n, b, 2)
    assert header.changed == 3  # the NaN is the same bits; each signed zero changed
    out = b.clone()
    apply_delta(header, payload, out)
    assert torch.equal(out, n)


def test_the_form_follows_the_share_of_changed_bf16_words():
    words = 1 << 20
    assert choose_format(words, 2, 0) is DeltaFormat.INDICES  # nothing to send but the header
    assert choose_format(words, 2, int(words * 0.02)) is DeltaFormat.INDICES
    assert choose_format(words, 2, int(words * 0.05)) is DeltaFormat.BITMASK
    assert choose_format(words, 2, int(words * 0.95)) is DeltaFormat.DENSE
    # at 5% of bf16 words changed a delta is 0.11 of the dense bytes
    assert encoded_bytes(DeltaFormat.BITMASK, words, 2, int(words * 0.05)) / (2 * words) < 0.115


def test_a_delta_that_does_not_fit_its_base_or_its_header_is_refused_before_a_word_changes():
    base = torch.arange(1024, dtype=torch.int64).to(torch.uint8)
    new = base.clone()
    new[:4] = 200  # two bf16 words of 512
    header, payload = encode_delta(new, base, 2)
    assert header.format is DeltaFormat.INDICES
    with pytest.raises(PlanError, match="new has 1024 bytes, base 512"):
        encode_delta(new, base[:512], 2)
    with pytest.raises(PlanError, match="not whole words of 4 bytes"):
        encode_delta(new[:1022], base[:1022], 4)
    target = base.clone()
    with pytest.raises(PlanError, match="cannot apply to a base of 1022 bytes"):
        apply_delta(header, payload, target[:1022])
    with pytest.raises(PlanError, match="carries 12 bytes, got 11"):
        apply_delta(header, payload[:11], target)
    bad = payload.clone()
    bad[:4] = torch.tensor([255, 255, 0, 0], dtype=torch.uint8)  # an index past the bucket
    with pytest.raises(PlanError, match="outside the bucket's 512"):
        apply_delta(header, bad, target)
    assert torch.equal(target, base)  # nothing was written
    mask_header = DeltaHeader(DeltaFormat.BITMASK, 512, 2, 2)
    mask_payload = torch.zeros(mask_header.payload_bytes, dtype=torch.uint8)
    mask_payload[0] = 0b111  # three words marked, two said
    with pytest.raises(PlanError, match="says 2 words changed, its mask marks 3"):
        apply_delta(mask_header, mask_payload, target)
    assert torch.equal(target, base)
