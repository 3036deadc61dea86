"""Affinity routing's rules, without Ray: one content-hash key picks the encoder replica and the
LLM replica, never at the cost of load.

- Encoder items: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam,
  SODA 2018; `BoundedLoadRing`): a hot image cannot pin one replica, replica churn moves only the
  keys of the replicas that changed, and identical items in flight meet on one replica.
- LLM requests: `prefix_hashes` chains a prompt's full blocks (token ids, and the content hash of
  each media item a block holds), and `PrefixRecord` remembers where each prefix was sent. A
  request goes to the replica that got its longest recorded prefix, unless that replica is over
  the same bound; then, and when nothing matches, power-of-two choices on load. The router's own
  record, not a digest the replicas report: it is exact for what this router sent, costs no
  extra call, and is current at once (a digest refreshed per step would lag and cost a call per
  replica); its misses (eviction, another router's sends) cost one prefill, never correctness,
  since these keys only choose a replica and never look up a cache.

`AffinityChooser` composes them into one router's decisions and its view of the loads: the app's
Serve request router (`deployments/serve/affinity_routing.py`) and the capacity planner
(`mmserve.capacity.routing`) both call it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from cachetools import LRUCache

from mmserve.inputs.media import PlaceholderRange


DECISIONS: Counter = Counter()  # (deployment, outcome) -> routings in this process (`Router.routing_stats`)


def stable_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def capacity(loads: Mapping[str, float], cost: float, epsilon: float) -> float:
    """The bound: ceil((1 + epsilon) x the mean load once `cost` is added), and never below `cost`
    (an idle replica always takes one item: with weighted items the mean alone could refuse all)."""
    return max(math.ceil((1 + epsilon) * (sum(loads.values()) + cost) / max(len(loads), 1)), cost)


class BoundedLoadRing:
    """Consistent hashing with bounded loads over `members` (replica ids)."""

    def __init__(self, members: Sequence[str], vnodes: int = 64):
        self.members = tuple(sorted(set(members)))
        points = sorted((stable_hash(f"{m}#{v}".encode()), m) for m in self.members for v in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [m for _, m in points]

    def preference(self, key: str) -> list[str]:
        """Every member once, in ring order from `key`'s point: its owner first."""
        start = bisect.bisect(self._hashes, stable_hash(key.encode()))
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):  # stops once every member is seen: a few points, not all
            seen.setdefault(self._owners[(start + i) % len(self._owners)])
            if len(seen) == len(self.members):
                break
        return list(seen)

    def owner(self, key: str, loads: Mapping[str, float], cost: float, epsilon: float,
              holders: Collection[str] = ()) -> str:
        """The first member in `key`'s preference that holds the key already (`holders`: no work
        to add); else the first whose load + `cost` fits the bound (the least loaded member if
        none does: an item larger than the bound alone)."""
        preference = self.preference(key)
        if held := [m for m in preference if m in holders]:
            return held[0]
        loads = {m: loads.get(m, 0.0) for m in self.members}
        bound = capacity(loads, cost, epsilon)
        return next((m for m in preference if loads[m] + cost <= bound), min(self.members, key=loads.__getitem__))


def prefix_hashes(token_ids: Sequence[int], ranges: Sequence[PlaceholderRange], media_keys: Sequence[str],
                  block_size: int, adapter: str = "") -> tuple[int, ...]:
    """One hash per full block of the prompt, each covering everything before it: the block's
    token ids and the content hash of every media item overlapping it (`media_keys[i]` for
    `ranges[i]`), so two prompts share a hash exactly where they share a prefix; under a LoRA
    `adapter` (its name) the chain starts from it, so no block is shared with the base's or another's."""
    hashes, previous = [], adapter.encode()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        media = [key for rng, key in zip(ranges, media_keys) if rng.offset < end and rng.offset + rng.length > start]
        data = previous + repr((tuple(token_ids[start:end]), media)).encode()
        previous = hashlib.blake2b(data, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return tuple(hashes)


class PrefixRecord:
    """Where this router sent each prompt prefix: block hash -> replica id, LRU-bounded."""

    def __init__(self, max_entries: int = 1 << 18):
        self._where: LRUCache[int, str] = LRUCache(maxsize=max_entries)

    def longest(self, hashes: Sequence[int], members: Sequence[str]) -> tuple[str | None, int]:
        """(the replica among `members` that got the longest recorded prefix, its length in
        blocks); (None, 0) when no prefix of `hashes` was sent to any of them."""
        live = set(members)
        for depth in range(len(hashes), 0, -1):
            if (member := self._where.get(hashes[depth - 1])) in live:
                return member, depth
        return None, 0

    def record(self, hashes: Sequence[int], member: str) -> None:
        for h in hashes:
            self._where[h] = member


class HolderRecord:
    """Which replicas this router sent each item key to (each caches what it encodes, and dedupes
    what is in flight): key -> replica ids, LRU-bounded. Exact for this router's sends; an
    eviction on the replica or a failed encode costs one encode there, never correctness."""

    def __init__(self, max_entries: int = 1 << 16):
        self._held: LRUCache[str, tuple[str, ...]] = LRUCache(maxsize=max_entries)

    def holders(self, key: str, members: Collection[str]) -> tuple[str, ...]:
        return tuple(m for m in self._held.get(key, ()) if m in members)

    def record(self, key: str, member: str) -> None:
        if member not in (held := self._held.get(key, ())):
            self._held[key] = (*held, member)


def power_of_two(members: Sequence[str], loads: Mapping[str, float], rng: random.Random) -> str:
    """The less loaded of two members drawn at random (one when there is one)."""
    if len(members) == 1:
        return members[0]
    a, b = rng.sample(list(members), 2)
    return a if loads.get(a, 0.0) <= loads.get(b, 0.0) else b


class AffinityChooser:
    """One router's affinity decisions over the replicas it is offered, and the loads it believes:
    the tokens it has in flight on each replica (routed, not completed; an item the replica already
    holds counts none). The caller reports each routing (`*_routed`, which returns the cost it
    added) and each completion (`completed`, with that cost).

    Attributes: `epsilon` (the bound's slack), `block_size` (tokens per prefix block), `loads`
    (replica id -> tokens in flight), `record` (`PrefixRecord`), `held` (`HolderRecord`), `ring`
    (the `BoundedLoadRing` over the replicas last offered, rebuilt when they change)."""

    def __init__(self, epsilon: float, block_size: int, rng: random.Random | None = None):
        self.epsilon, self.block_size = epsilon, block_size
        self.ring: BoundedLoadRing | None = None
        self.record, self.held = PrefixRecord(), HolderRecord()
        self.loads: Counter = Counter()
        self.rng = rng or random.Random()

    def choose_encoder(self, items: Sequence[tuple[str, int]], ids: Sequence[str]) -> tuple[str, str]:
        """(replica, outcome) for one encoder call of `items` ((content hash, cost in tokens)), keyed
        by its first item: a replica holding it ("held"), else its ring owner within the bound
        ("owner"), else the next in its preference that fits ("overflow")."""
        if self.ring is None or self.ring.members != tuple(sorted(set(ids))):
            self.ring = BoundedLoadRing(ids)  # churn: rebuilt over the live replicas
        key, cost = items[0][0], sum(c for _, c in items)
        holders = self.held.holders(key, ids)
        owner = self.ring.owner(key, {i: self.loads[i] for i in ids}, cost, self.epsilon, holders)
        if owner in holders:
            return owner, "held"
        return owner, "owner" if owner == self.ring.preference(key)[0] else "overflow"

    def choose_llm(self, hashes: Sequence[int], prompt_tokens: int, max_tokens: int,
                   ids: Sequence[str]) -> tuple[str, str, int]:
        """(replica, outcome, prefix blocks it likely holds) for one LLM request: the replica that
        got its longest recorded prefix unless over the bound ("prefix_hit"), else power-of-two
        choices ("overloaded" when a prefix's replica was passed over, "no_prefix")."""
        loads = {i: self.loads[i] for i in ids}
        replica, depth = self.record.longest(hashes, ids)
        cost = self.llm_work(prompt_tokens, max_tokens, depth)
        if replica is not None and loads[replica] + cost <= capacity(loads, cost, self.epsilon):
            return replica, "prefix_hit", depth
        return power_of_two(ids, loads, self.rng), "overloaded" if replica is not None else "no_prefix", 0

    def encoder_routed(self, items: Sequence[tuple[str, int]], replica: str) -> int:
        """Record a call of `items` sent to `replica`; the tokens it queued there."""
        cost = sum(c for key, c in items if not self.held.holders(key, (replica,)))  # a held item: a hit there
        for key, _ in items:
            self.held.record(key, replica)
        self.loads[replica] += cost
        return cost

    def llm_routed(self, hashes: Sequence[int], prompt_tokens: int, max_tokens: int, replica: str) -> int:
        """Record a request sent to `replica`; the tokens of work it queued there."""
        cost = self.llm_work(prompt_tokens, max_tokens, self.record.longest(hashes, (replica,))[1])
        self.record.record(hashes, replica)
        self.loads[replica] += cost
        return cost

    def completed(self, replica: str, cost: int) -> None:
        self.loads[replica] -= cost

    def llm_work(self, prompt_tokens: int, max_tokens: int, cached_blocks: int) -> int:
        """Tokens an LLM replica still has to run for a request: its prompt less the blocks it
        likely holds cached, plus the most it decodes (a request holds a decode slot for all of
        them, so prompt tokens alone would count a long answer as no load)."""
        return prompt_tokens - min(cached_blocks * self.block_size, prompt_tokens) + max_tokens
