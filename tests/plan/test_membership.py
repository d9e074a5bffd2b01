import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from refit.membership import (
    NoSurvivingShards,
    RefitMembership,
    desired_membership,
    generation_ranks,
    plan_refit_membership,
    should_rebuild,
)

SMALL = [
    (dp, wps, train)
    for dp in range(1, 5)
    for wps in range(1, 4)
    for train in range(1, 4)
]


def subsets(n: int):
    for k in range(n + 1):
        yield from itertools.combinations(range(n), k)


@st.composite
def topologies(draw):
    dp = draw(st.integers(1, 8))
    wps = draw(st.integers(1, 8))
    train = draw(st.integers(1, 16))
    absent = draw(st.sets(st.integers(0, dp - 1), max_size=dp - 1))
    return dp, wps, train, absent


def full(dp, wps, train) -> RefitMembership:
    return desired_membership(absent_shards=[], dp_size=dp, total_gen_workers=dp * wps, train_world_size=train)


@pytest.mark.parametrize("dp,wps,train", SMALL)
def test_every_small_topology(dp, wps, train):
    for absent in subsets(dp):
        survivors = [s for s in range(dp) if s not in absent]
        kwargs = dict(dp_size=dp, total_gen_workers=dp * wps, train_world_size=train)
        if not survivors:
            with pytest.raises(NoSurvivingShards):
                desired_membership(absent_shards=absent, **kwargs)
            continue
        m = desired_membership(absent_shards=absent, **kwargs)
        assert m == plan_refit_membership(surviving_shards=survivors, **kwargs)
        assert m.surviving_shards == survivors
        assert m.train_world_size == train
        assert m.workers_per_shard == wps
        assert m.world_size == train + len(survivors) * wps
        # Generation ranks tile train_world_size .. world_size - 1 exactly, in shard order.
        ranks = [r for s in survivors for r in generation_ranks(m, s)]
        assert ranks == list(range(train, m.world_size))
        for s in absent:
            with pytest.raises(ValueError):
                generation_ranks(m, s)


@given(topologies(), st.randoms())
def test_layout_properties(topology, rnd):
    dp, wps, train, absent = topology
    survivors = [s for s in range(dp) if s not in absent]
    shuffled = list(survivors)
    rnd.shuffle(shuffled)
    m = plan_refit_membership(surviving_shards=shuffled, dp_size=dp, total_gen_workers=dp * wps, train_world_size=train)
    assert list(m.shard_prefixes) == survivors  # laid out in shard order, whatever the input order
    assert list(m.shard_prefixes.values()) == [i * wps for i in range(len(survivors))]  # contiguous from 0
    assert m.world_size == train + len(survivors) * wps
    assert m.gen_world_size == len(survivors) * wps
    assert m == desired_membership(absent_shards=sorted(absent), dp_size=dp, total_gen_workers=dp * wps,
                                   train_world_size=train)


@given(topologies(), st.booleans())
def test_should_rebuild_first_refit_and_changes(topology, force):
    dp, wps, train, absent = topology
    kwargs = dict(dp_size=dp, total_gen_workers=dp * wps, train_world_size=train)
    desired = desired_membership(absent_shards=absent, **kwargs)
    # built=None is the full fleet: a rebuild is needed exactly when someone is absent.
    assert should_rebuild(desired=desired, built=None, absent_shards=absent, force=force) == bool(absent)
    rebuild = should_rebuild(desired=desired, built=full(dp, wps, train), absent_shards=absent, force=force)
    assert rebuild == bool(absent)
    # Already built over exactly the desired fleet: only a forced rebuild with someone absent.
    assert should_rebuild(desired=desired, built=desired, absent_shards=absent, force=force) == (force and bool(absent))


@given(topologies(), st.booleans())
def test_restarted_shard_is_readmitted(topology, force):
    dp, wps, train, absent = topology
    if not absent:
        return
    kwargs = dict(dp_size=dp, total_gen_workers=dp * wps, train_world_size=train)
    built = desired_membership(absent_shards=absent, **kwargs)
    # Every absent shard restarts: nobody is absent any more, yet the built communicator lacks them.
    desired = desired_membership(absent_shards=[], **kwargs)
    assert should_rebuild(desired=desired, built=built, absent_shards=[], force=force)
    # One of them restarts, the others are still gone.
    back = min(absent)
    still = absent - {back}
    desired = desired_membership(absent_shards=still, **kwargs)
    assert should_rebuild(desired=desired, built=built, absent_shards=still, force=force)


def test_force_after_abort_rebuilds_identical_membership():
    kwargs = dict(dp_size=3, total_gen_workers=6, train_world_size=2)
    built = desired_membership(absent_shards=[1], **kwargs)
    desired = desired_membership(absent_shards=[1], **kwargs)
    assert not should_rebuild(desired=desired, built=built, absent_shards=[1], force=False)
    assert should_rebuild(desired=desired, built=built, absent_shards=[1], force=True)


@pytest.mark.parametrize("built_is_none", [True, False])
def test_frozen_but_alive_rank_falls_through(built_is_none):
    # A frozen rank never becomes absent: forcing would rebuild over it and hang again.
    kwargs = dict(dp_size=2, total_gen_workers=4, train_world_size=1)
    desired = desired_membership(absent_shards=[], **kwargs)
    built = None if built_is_none else desired_membership(absent_shards=[], **kwargs)
    assert should_rebuild(desired=desired, built=built, absent_shards=[], force=True) is False


def test_should_rebuild_rejects_contradiction():
    kwargs = dict(dp_size=2, total_gen_workers=2, train_world_size=1)
    desired = desired_membership(absent_shards=[], **kwargs)
    with pytest.raises(ValueError, match="absent"):
        should_rebuild(desired=desired, built=None, absent_shards=[0], force=False)


def test_absent_duplicates_are_one_absence():
    kwargs = dict(dp_size=3, total_gen_workers=3, train_world_size=1)
    assert desired_membership(absent_shards=[2, 2], **kwargs) == desired_membership(absent_shards=[2], **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(surviving_shards=[0], dp_size=2, total_gen_workers=3, train_world_size=1),  # not divisible
        dict(surviving_shards=[0], dp_size=0, total_gen_workers=2, train_world_size=1),
        dict(surviving_shards=[0], dp_size=-1, total_gen_workers=2, train_world_size=1),
        dict(surviving_shards=[0], dp_size=1, total_gen_workers=0, train_world_size=1),
        dict(surviving_shards=[0], dp_size=1, total_gen_workers=1, train_world_size=0),
        dict(surviving_shards=[0], dp_size=1.0, total_gen_workers=1, train_world_size=1),
        dict(surviving_shards=[2], dp_size=2, total_gen_workers=2, train_world_size=1),  # unknown shard
        dict(surviving_shards=[-1], dp_size=2, total_gen_workers=2, train_world_size=1),
        dict(surviving_shards=[0, 0], dp_size=2, total_gen_workers=2, train_world_size=1),  # duplicate
    ],
)
def test_plan_errors(kwargs):
    with pytest.raises(ValueError):
        plan_refit_membership(**kwargs)


def test_no_surviving_shards():
    with pytest.raises(NoSurvivingShards):
        plan_refit_membership(surviving_shards=[], dp_size=2, total_gen_workers=2, train_world_size=1)
    with pytest.raises(NoSurvivingShards):
        desired_membership(absent_shards=[1, 0], dp_size=2, total_gen_workers=2, train_world_size=1)
    assert issubclass(NoSurvivingShards, RuntimeError)


def test_desired_rejects_unknown_absent_shard():
    with pytest.raises(ValueError, match="unknown"):
        desired_membership(absent_shards=[5], dp_size=2, total_gen_workers=2, train_world_size=1)


def test_keyword_only():
    with pytest.raises(TypeError):
        plan_refit_membership([0], 1, 1, 1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        desired_membership([], 1, 1, 1)  # type: ignore[misc]


def test_membership_value_semantics():
    prefixes = {2: 0, 0: 3}
    m = RefitMembership(world_size=7, train_world_size=1, shard_prefixes=prefixes, workers_per_shard=3)
    assert m.surviving_shards == [0, 2]  # kept in shard order
    prefixes[5] = 6  # the caller's dict is not the membership's
    assert m.surviving_shards == [0, 2]
    same = RefitMembership(world_size=7, train_world_size=1, shard_prefixes={0: 3, 2: 0}, workers_per_shard=3)
    assert m == same and hash(m) == hash(same)
    assert len({m, same}) == 1
    with pytest.raises(AttributeError):
        m.world_size = 9  # type: ignore[misc]


@st.composite
def mixed_topologies(draw):
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=7))
    train = draw(st.integers(1, 9))
    absent = draw(st.sets(st.integers(0, len(sizes) - 1), max_size=len(sizes) - 1))
    return sizes, train, absent


@given(mixed_topologies(), st.randoms())
def test_shards_of_different_sizes_tile_the_generation_block(topology, rnd):
    """Two shards of TP2 and one of TP1, and every other mix: each survivor gets exactly its own
    size in ranks, packed in shard order; a change of survivors, in either direction, rebuilds."""
    sizes, train, absent = topology
    kw = dict(dp_size=len(sizes), total_gen_workers=sum(sizes), train_world_size=train, shard_sizes=sizes)
    survivors = [s for s in range(len(sizes)) if s not in absent]
    shuffled = list(survivors)
    rnd.shuffle(shuffled)
    m = plan_refit_membership(surviving_shards=shuffled, **kw)
    assert m == desired_membership(absent_shards=sorted(absent), **kw)
    assert m.world_size == train + sum(sizes[s] for s in survivors)
    ranks = [generation_ranks(m, s) for s in survivors]
    assert [len(r) for r in ranks] == [sizes[s] for s in survivors]
    assert [r for rs in ranks for r in rs] == list(range(train, m.world_size))
    assert m.workers_per_shard == max(sizes)

    whole = desired_membership(absent_shards=[], **kw)
    assert not should_rebuild(desired=whole, built=None, absent_shards=[], force=False)
    assert should_rebuild(desired=m, built=None, absent_shards=sorted(absent), force=False) == bool(absent)
    assert should_rebuild(desired=whole, built=m, absent_shards=[], force=False) == bool(absent)  # re-admission
    if absent:  # same survivors, different sizes: a different communicator
        other = [n + 1 if i in survivors else n for i, n in enumerate(sizes)]
        m2 = desired_membership(absent_shards=sorted(absent), dp_size=len(sizes), total_gen_workers=sum(other),
                                train_world_size=train, shard_sizes=other)
        assert m2 != m


def test_shard_sizes_are_checked_naming_the_parameter():
    kw = dict(absent_shards=[], dp_size=3, train_world_size=2)
    assert desired_membership(total_gen_workers=5, shard_sizes=[2, 2, 1], **kw).shard_size(2) == 1
    with pytest.raises(ValueError, match="shard_sizes has 2 entries"):
        desired_membership(total_gen_workers=5, shard_sizes=[2, 3], **kw)
    with pytest.raises(ValueError, match=r"add up to 5 workers, but total_gen_workers=6"):
        desired_membership(total_gen_workers=6, shard_sizes=[2, 2, 1], **kw)
    with pytest.raises(ValueError, match=r"shard_sizes\[2\] must be an int >= 1"):
        desired_membership(total_gen_workers=4, shard_sizes=[2, 2, 0], **kw)
