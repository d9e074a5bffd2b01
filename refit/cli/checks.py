"""Argument types shared by the subcommands: bad values are refused while the line is parsed.

Each lower-case function is an argparse ``type=``: it raises ``argparse.ArgumentTypeError``,
argparse names the flag, and ``refit``'s parser reports it in one line with exit code 2,
before a subcommand imports anything heavy or starts a process. Checks that need several
flags together (``check_ranks``, ``check_cuda``) raise ``refit.errors.ConfigError`` from the
subcommand instead, still before anything starts.

Sizes have ceilings as well as floors: a count that parses is not one the host can run. A
bench of 100,000 ranks forks processes until the machine stops, and a 10^8-layer model plans
without end, before either could fail on its own.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable


def _bounded(kind: type, ok: Callable[[int | float], bool], must: str, name: str) -> Callable[[str], int | float]:
    """An argparse type named ``name``: the text read as ``kind`` (a finite number), refused unless ``ok``."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


positive_int = _bounded(int, lambda v: v >= 1, "a positive integer", "positive_int")
non_negative_int = _bounded(int, lambda v: v >= 0, "0 or more", "non_negative_int")
positive_float = _bounded(float, lambda v: v > 0, "a positive number", "positive_float")
non_negative_float = _bounded(float, lambda v: v >= 0, "0 or more", "non_negative_float")
unit_fraction = _bounded(float, lambda v: 0 <= v <= 1, "within [0, 1]", "unit_fraction")


# Ranks a command may start per core of this host (os.cpu_count()), each a process, a Ray actor
# or a thread. Ranks mostly wait on their peers, so several share a core (the default demo runs
# 9 on 2 cores); past this the host thrashes instead of measuring anything.
RANKS_PER_CORE = 8
# Ranks ``refit plan`` simulates per layout: no process starts, but every rank's roster is built
# and merged. Several times the largest RL fleets.
MAX_PLANNED_RANKS = 65536


def rank_budget() -> tuple[int, int]:
    """(cores of this host, ranks a command may start on it)."""
    cores = os.cpu_count() or 1
    return cores, cores * RANKS_PER_CORE


def check_ranks(count: int, flags: str) -> None:
    """Refuse a run of ``count`` ranks (``flags``: the flags and values that made it) above ``rank_budget``."""
    from refit.errors import ConfigError

    cores, budget = rank_budget()
    if count > budget:
        raise ConfigError(f"{flags}: {count} ranks is more than the {budget} this host runs ({RANKS_PER_CORE} per "
                          f"core, {cores} cores; a rank is a process, a Ray actor or a thread); nothing was started")


def check_cuda(flags: str) -> None:
    """Refuse ``--device cuda`` on a host where torch sees no GPU, before any process or Ray starts."""
    import torch

    from refit.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError(f"{flags}: torch sees no GPU on this host (torch.cuda.is_available() is False); "
                          "nothing was started")


def planned_ranks(text: str) -> int:
    """A number of simulated ranks: positive, at most ``MAX_PLANNED_RANKS``."""
    value = positive_int(text)
    if value > MAX_PLANNED_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PLANNED_RANKS} ranks, got {text!r}")
    return value


def model_size(key: str) -> Callable[[str], int]:
    """A type for a model size given as a flag, bounded like the ``config.json`` key ``key``
    (``refit.models.specs.CONFIG_LIMITS``): a flag builds the same tensors a config does."""

    def parse(text: str) -> int:
        from refit.models.specs import CONFIG_LIMITS

        value = positive_int(text)
        if value > CONFIG_LIMITS[key]:
            raise argparse.ArgumentTypeError(f"must be at most {CONFIG_LIMITS[key]} (the {key} limit of "
                                             f"refit.models.specs.CONFIG_LIMITS), got {text!r}")
        return value

    parse.__name__ = "model_size"
    return parse


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
