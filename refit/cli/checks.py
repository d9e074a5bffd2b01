"""Argument types shared by the subcommands: bad values are refused while the line is parsed.

Each function is an argparse ``type=``: it raises ``argparse.ArgumentTypeError``, argparse
names the flag, and ``refit``'s parser reports it in one line with exit code 2, before a
subcommand imports anything heavy or starts a process. Checks that need several flags
together raise ``refit.errors.ConfigError`` from the subcommand instead.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """``64,128,256`` -> ``[64, 128, 256]``; every entry a positive integer, at least one."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    out = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not a positive integer")
        out.append(int(part))
    return out


def choice_list(choices: Iterable[str], *, allow_empty: bool = False) -> Callable[[str], list[str]]:
    """A type for a comma list of ``choices``, each known (and at least one unless ``allow_empty``)."""
    known = tuple(choices)

    def parse(text: str) -> list[str]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts and not allow_empty:
            raise argparse.ArgumentTypeError(f"give at least one of {', '.join(known)}")
        for part in parts:
            if part not in known:
                raise argparse.ArgumentTypeError(f"unknown {part!r}; use {', '.join(known)}")
        return parts

    parse.__name__ = "choice_list"
    return parse


def engine_dtype(text: str) -> str:
    """An engine weights dtype: a dtype name, or ``fp8`` (128 x 128 block-scaled e4m3 linear weights)."""
    return "fp8" if text.lower() == "fp8" else dtype(text)


def dtype(text: str) -> str:
    """A weights dtype, by its canonical name (``bf16`` -> ``bfloat16``)."""
    from refit.errors import ConfigError
    from refit.models.specs import dtype_name

    try:
        return dtype_name(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("dtype: ")) from None


def writable_file(text: str) -> str:
    """A file this run will write: its folder must exist and be writable now, not after the work."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder!r} is not writable")
    return text
