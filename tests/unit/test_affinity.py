"""Affinity routing's rules (mmserve/routing/affinity.py), without Ray: consistent hashing with bounded
loads, and the prefix record."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.routing.affinity import BoundedLoadRing, HolderRecord, PrefixRecord, capacity, power_of_two, prefix_hashes
from mmserve.inputs.media import PlaceholderRange

members = st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=8, unique=True)
keys = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=300)
epsilons = st.sampled_from([0.0, 0.1, 0.25, 1.0])


@settings(max_examples=60, deadline=None)
@given(members, keys, epsilons)
def test_no_replica_is_ever_above_the_bound(replicas, stream, epsilon):
    """Keys of unit cost arrive one by one (a hot key repeats): every replica stays within
    ceil((1 + epsilon) x the mean) at every step."""
    ring, loads = BoundedLoadRing(replicas), dict.fromkeys(replicas, 0)
    for key in stream:
        owner = ring.owner(key, loads, 1, epsilon)
        loads[owner] += 1
        assert max(loads.values()) <= math.ceil((1 + epsilon) * sum(loads.values()) / len(replicas))


@settings(max_examples=60, deadline=None)
@given(members, st.text("xyz", min_size=1, max_size=4), keys)
def test_churn_moves_only_the_keys_of_the_replicas_that_changed(replicas, newcomer, stream):
    """Unloaded (nothing over the bound): adding a replica moves keys only to it; removing one
    moves only its keys."""
    before = BoundedLoadRing(replicas)
    grown = BoundedLoadRing([*replicas, newcomer])
    for key in stream:
        old, new = before.owner(key, {}, 0, 1.0), grown.owner(key, {}, 0, 1.0)
        assert old == new or new == newcomer
    if len(replicas) > 1:
        gone = replicas[0]
        shrunk = BoundedLoadRing(replicas[1:])
        for key in stream:
            old = before.owner(key, {}, 0, 1.0)
            assert old == gone or shrunk.owner(key, {}, 0, 1.0) == old


@settings(max_examples=40, deadline=None)
@given(members, keys, epsilons)
def test_under_the_bound_a_key_goes_to_its_first_preference_and_overflow_to_the_next(replicas, stream, epsilon):
    ring, loads = BoundedLoadRing(replicas), dict.fromkeys(replicas, 0)
    for key in stream:
        preference = ring.preference(key)
        assert sorted(preference) == sorted(replicas)
        owner = ring.owner(key, loads, 1, epsilon)
        bound = capacity(loads, 1, epsilon)
        skipped = preference[:preference.index(owner)]
        assert all(loads[m] + 1 > bound for m in skipped)  # only full replicas are passed over
        loads[owner] += 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=2, max_size=8, unique=True),
       st.lists(st.integers(0, 40), min_size=1, max_size=300), epsilons)
def test_repeats_go_where_they_went_and_queued_work_stays_within_the_bound(replicas, stream, epsilon):
    """Items arrive (a key repeats: 41 distinct) and the oldest in flight completes every third
    step. A key sent before goes back to a live replica that got it, at no queued cost (a cache
    hit or an in-flight dedupe there), so each key is encoded by one replica, once; a replica
    taking queued work stays within the bound."""
    ring, held, loads = BoundedLoadRing(replicas), HolderRecord(), dict.fromkeys(replicas, 0)
    in_flight, encodes = [], []
    for step, k in enumerate(stream):
        key = f"img-{k}"
        holders = held.holders(key, replicas)
        owner = ring.owner(key, loads, 1, epsilon, holders)
        if holders:
            assert owner in holders
        else:
            bound = capacity(loads, 1, epsilon)  # completions elsewhere may lower the mean later
            loads[owner] += 1
            in_flight.append(owner)
            encodes.append(key)
            assert loads[owner] <= bound
        held.record(key, owner)
        if step % 3 == 2 and in_flight:
            loads[in_flight.pop(0)] -= 1
    assert len(encodes) == len(set(encodes))  # no key encoded twice in the cluster


def test_holders_are_live_replicas_only():
    held = HolderRecord()
    held.record("k", "r1")
    held.record("k", "r2")
    held.record("k", "r1")
    assert held.holders("k", ["r1", "r2"]) == ("r1", "r2") and held.holders("k", ["r2", "r3"]) == ("r2",)
    ring = BoundedLoadRing(["r2", "r3"])
    assert ring.owner("k", {"r2": 100, "r3": 0}, 1, 0.0, held.holders("k", ["r2", "r3"])) == "r2"
    assert held.holders("other", ["r1"]) == ()


def test_an_item_larger_than_the_bound_goes_to_the_least_loaded():
    ring = BoundedLoadRing(["a", "b"])
    assert ring.owner("k", {"a": 5, "b": 1}, 1000, 0.25) == "b"


def test_prefix_hashes_cover_everything_before_and_the_media_identity():
    tokens = list(range(100, 164))
    image = [PlaceholderRange(20, 8)]
    a = prefix_hashes(tokens, image, ["img-A"], 16)
    assert len(a) == 4
    assert prefix_hashes(tokens[:40] + [1] * 24, image, ["img-A"], 16)[:2] == a[:2]  # same first 32 tokens
    b = prefix_hashes(tokens, image, ["img-B"], 16)  # another image at tokens 20..27: blocks 1.. differ
    assert b[0] == a[0] and b[1] != a[1] and b[3] != a[3]
    assert prefix_hashes(tokens[:15], [], [], 16) == ()  # no full block


def test_the_record_finds_the_longest_prefix_on_a_live_replica():
    record = PrefixRecord()
    short, long_ = (1, 2), (1, 2, 3, 4)
    record.record(short, "r1")
    record.record(long_, "r2")
    assert record.longest((1, 2, 3, 4, 5), ["r1", "r2"]) == ("r2", 4)
    assert record.longest((1, 2, 9), ["r1", "r2"]) == ("r2", 2)  # block 2 was last sent to r2
    assert record.longest((1, 2, 3, 4), ["r1"]) == (None, 0)  # r2 gone; its entries cover 1..4
    assert record.longest((7,), ["r1", "r2"]) == (None, 0)


def test_the_record_is_bounded():
    record = PrefixRecord(max_entries=10)
    for i in range(100):
        record.record((i,), "r")
    assert record.longest((5,), ["r"]) == (None, 0) and record.longest((99,), ["r"]) == ("r", 1)


def test_power_of_two_takes_the_less_loaded_of_two():
    rng = random.Random(0)
    picks = {power_of_two(["a", "b", "c"], {"a": 0, "b": 5, "c": 9}, rng) for _ in range(200)}
    assert "c" not in picks and picks == {"a", "b"}  # c is never the lower of a pair


def test_affinity_dispatch_keeps_the_size_balanced_spread_for_cold_items_only():
    """Cold items are grouped as without affinity (a small request: one call); an item this router
    sent before goes alone, so the request router can send it back to the replica holding it."""
    from deployments.core.dispatch import EncoderPoolDispatcher
    from mmserve.request.encode_calls import SPREAD_MIN_GROUP_TOKENS, spread
    from tests.support.encoder_fakes import fake_item

    dispatcher = EncoderPoolDispatcher(encoder=None, affinity=True)
    small = [fake_item(i, 64) for i in range(3)]
    assert dispatcher._groups(small) == [[0, 1, 2]] == spread([64] * 3)
    big = [fake_item(10 + i, SPREAD_MIN_GROUP_TOKENS) for i in range(2)]
    mixed = [small[1], big[0], fake_item(7, 64), big[1], small[2]]
    assert dispatcher._groups(mixed) == [[0], [4], [1, 2], [3]]  # seen: 0 and 4; cold 1, 2, 3 spread by size
    assert dispatcher._groups(mixed) == [[i] for i in range(5)]
    assert EncoderPoolDispatcher(encoder=None)._groups(mixed) == spread([m.cost for m in mixed])
