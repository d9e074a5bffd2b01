"""Who belongs to the refit communicator, and where each member sits in it.

Pure arithmetic, kept apart from the code that dispatches a rebuild, for two reasons.
It is the part that must be exactly right: a rank layout that is off by one still
builds a communicator, and the refit over it writes the wrong slices without a single
error. And it is the part that is hardest to exercise for real: losing a generation
shard while a fleet remains takes at least a trainer and two shards, so the rules
are pinned down here, where every small topology can be enumerated in a unit test.

Layout of the communicator: trainer ranks ``0 .. train_world_size - 1`` come first and
are never excluded, so the broadcast root (rank 0) survives every rebuild. The workers
of the surviving generation shards follow, shard by shard in shard-index order.

Shards may differ in size (``shard_sizes``, e.g. two shards of TP2 and one of TP1, as a
fleet that mixes engine layouts has); without it every shard has
``total_gen_workers // dp_size`` workers, as in the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from refit.errors import RefitError

__all__ = [
    "NoSurvivingShards",
    "RefitMembership",
    "desired_membership",
    "generation_ranks",
    "plan_refit_membership",
    "should_rebuild",
]


@dataclass(frozen=True)
class RefitMembership:
    """Where each surviving generation shard sits in the (re)built refit communicator.

    Attributes:
        world_size: total ranks, trainers plus the workers of the surviving shards.
        train_world_size: trainer ranks; they are never excluded, which is what keeps
            the broadcast root at rank 0 across a rebuild.
        shard_prefixes: surviving shard index -> offset of its first worker within the
            generation block, ordered by shard index.
        workers_per_shard: workers backing one shard (tp x pp); the largest shard's when
            ``shard_sizes`` is given.
        shard_sizes: workers of every shard of the fleet (survivors or not), by shard index;
            None when all shards have ``workers_per_shard``.
    """

    world_size: int
    train_world_size: int
    shard_prefixes: dict[int, int]
    workers_per_shard: int
    shard_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Own a copy in shard order: the instance is frozen, so a caller mutating the
        # dict it passed in must not change a membership already recorded as "built".
        object.__setattr__(self, "shard_prefixes", dict(sorted(self.shard_prefixes.items())))
        if self.shard_sizes is not None:
            object.__setattr__(self, "shard_sizes", tuple(self.shard_sizes))

    def __hash__(self) -> int:
        return hash((self.world_size, self.train_world_size, tuple(self.shard_prefixes.items()),
                     self.workers_per_shard, self.shard_sizes))

    def shard_size(self, shard: int) -> int:
        """Workers of ``shard``."""
        return self.workers_per_shard if self.shard_sizes is None else self.shard_sizes[shard]

    @property
    def surviving_shards(self) -> list[int]:
        return list(self.shard_prefixes)

    @property
    def gen_world_size(self) -> int:
        """Generation ranks in the communicator."""
        return self.world_size - self.train_world_size


class NoSurvivingShards(RefitError, RuntimeError):
    """Every generation shard is gone, so there is nothing to rebuild onto."""


def _check_size(name: str, value: int, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _workers_per_shard(dp_size: int, total_gen_workers: int, train_world_size: int,
                       shard_sizes: Sequence[int] | None = None) -> int:
    _check_size("dp_size", dp_size)
    _check_size("total_gen_workers", total_gen_workers)
    _check_size("train_world_size", train_world_size)
    if shard_sizes is not None:
        if len(shard_sizes) != dp_size:
            raise ValueError(f"shard_sizes has {len(shard_sizes)} entries {list(shard_sizes)}, but dp_size={dp_size}")
        for i, n in enumerate(shard_sizes):
            _check_size(f"shard_sizes[{i}]", n)
        if sum(shard_sizes) != total_gen_workers:
            raise ValueError(f"shard_sizes {list(shard_sizes)} add up to {sum(shard_sizes)} workers, "
                             f"but total_gen_workers={total_gen_workers}")
        return max(shard_sizes)
    if total_gen_workers % dp_size:
        raise ValueError(
            f"total_gen_workers={total_gen_workers} is not divisible by dp_size={dp_size}: "
            "without shard_sizes every generation shard has the same number of workers"
        )
    return total_gen_workers // dp_size


def _check_shards(name: str, shards: Sequence[int], dp_size: int) -> None:
    unknown = [s for s in shards if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < dp_size]
    if unknown:
        raise ValueError(f"{name}: unknown shard index(es) {unknown}; shards are 0..{dp_size - 1}")


def plan_refit_membership(
    *,
    surviving_shards: Sequence[int],
    dp_size: int,
    total_gen_workers: int,
    train_world_size: int,
    shard_sizes: Sequence[int] | None = None,
) -> RefitMembership:
    """Lay out a refit communicator that contains only the surviving generation shards.

    Survivors are packed contiguously from the start of the generation block, in shard
    order, instead of keeping a hole where a dead shard was. The hole would not
    be harmless: the reshard transport sizes its destination mesh as a plain range of
    ranks starting at the generation offset, so a gap shifts every later rank onto
    slices it does not own. Packing is also what shrinking a live communicator does,
    so a rebuilt communicator and a shrunk one describe the same world.

    Raises:
        NoSurvivingShards: ``surviving_shards`` is empty.
        ValueError: the topology is inconsistent, or a shard is unknown or listed twice.
    """
    per_shard = _workers_per_shard(dp_size, total_gen_workers, train_world_size, shard_sizes)
    _check_shards("surviving_shards", surviving_shards, dp_size)
    if len(set(surviving_shards)) != len(surviving_shards):
        raise ValueError(f"surviving_shards lists a shard more than once: {list(surviving_shards)}")
    if not surviving_shards:
        raise NoSurvivingShards(f"all {dp_size} generation shards are gone; there is nothing to refit")
    return _packed(train_world_size, sorted(surviving_shards), per_shard, shard_sizes)


def _packed(train_world_size: int, shards: Sequence[int], per_shard: int,
            shard_sizes: Sequence[int] | None) -> RefitMembership:
    prefixes, offset = {}, 0
    for shard in shards:
        prefixes[shard] = offset
        offset += per_shard if shard_sizes is None else shard_sizes[shard]
    return RefitMembership(
        world_size=train_world_size + offset,
        train_world_size=train_world_size,
        shard_prefixes=prefixes,
        workers_per_shard=per_shard,
        shard_sizes=None if shard_sizes is None else tuple(shard_sizes),
    )


def desired_membership(
    *,
    absent_shards: Sequence[int],
    dp_size: int,
    total_gen_workers: int,
    train_world_size: int,
    shard_sizes: Sequence[int] | None = None,
) -> RefitMembership:
    """The membership the refit communicator should have, given who is absent now.

    Stated as a target rather than as a change, so one call serves both directions: a
    shard dropping out and a restarted shard coming back are each just a different
    target. Comparing the target with what was built is what re-admits a recovered
    engine; reasoning from the absent set alone, "nobody is absent" looks exactly like
    "nothing to do" and the restarted shard would stay shut out for the rest of the run.

    Raises:
        NoSurvivingShards: every shard is absent.
        ValueError: the topology is inconsistent or an absent shard is unknown.
    """
    _workers_per_shard(dp_size, total_gen_workers, train_world_size, shard_sizes)
    _check_shards("absent_shards", absent_shards, dp_size)
    absent = set(absent_shards)  # the same shard reported twice is still one absence
    return plan_refit_membership(
        surviving_shards=[s for s in range(dp_size) if s not in absent],
        dp_size=dp_size,
        total_gen_workers=total_gen_workers,
        train_world_size=train_world_size,
        shard_sizes=shard_sizes,
    )


def should_rebuild(
    *,
    desired: RefitMembership,
    built: RefitMembership | None,
    absent_shards: Sequence[int],
    force: bool,
) -> bool:
    """Whether the refit communicator must be rebuilt before the next transfer.

    Compares ``desired`` with ``built`` rather than asking "is anyone absent": asked
    that way, the answer turns False the moment a restarted shard returns, and the
    shard is never let back into the communicator it should rejoin.

    ``built=None`` means the full fleet. The initial build always spans every shard,
    so an unrecorded membership is known, not unknown; treating it as a difference
    would force a pointless rebuild on the first refit of every run.

    ``force`` says the communicator is dead rather than stale: after an abort the
    membership may be unchanged, and skipping the rebuild would retry over nothing.
    It only takes effect when some shard IS absent. A rank that froze but stays alive
    never shows up as absent; forcing a rebuild then would produce a communicator that
    still contains it, and the retry would hang exactly like the first attempt. That
    case returns False, so the caller can report that no absent shard was identified
    and stop.

    Args:
        desired: what the membership should be, given who is absent now.
        built: what the live communicator was built over; None for the full fleet.
        absent_shards: the shards currently absent, as the caller sees them.
        force: the caller knows the communicator is gone, not merely stale.
    """
    absent = set(absent_shards)
    listed_twice = absent.intersection(desired.shard_prefixes)
    if listed_twice:
        raise ValueError(f"shard(s) {sorted(listed_twice)} are both absent and in the desired membership")
    if built is None:
        # The full fleet: whoever should be there, plus whoever is missing.
        every = sorted(absent.union(desired.shard_prefixes))
        built = _packed(desired.train_world_size, every, desired.workers_per_shard, desired.shard_sizes)
    if desired != built:
        return True
    return bool(force) and bool(absent)


def generation_ranks(membership: RefitMembership, shard: int) -> list[int]:
    """Communicator ranks of one surviving shard's workers, in worker order."""
    if shard not in membership.shard_prefixes:
        raise ValueError(f"shard {shard} is not a member; surviving shards are {membership.surviving_shards}")
    first = membership.train_world_size + membership.shard_prefixes[shard]
    return list(range(first, first + membership.shard_size(shard)))
