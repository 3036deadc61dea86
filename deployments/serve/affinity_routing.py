"""`AffinityRequestRouter`: affinity routing inside Serve's own request-router API.

Serve instantiates it in each caller (our Router deployment's replicas) for the Encoder and LLM
deployments (`request_router_config`), so routing stays inside Serve's replica tracking, queue
probing, backoff and autoscaling. It reads the key from the call's argument, which already holds
it: an `Encoder.encode` call carries its items (content hash, cost in tokens; the key is the
first item's: the dispatcher sends an item seen before alone, cold items in size-balanced
groups), an `LLM.generate` call our `handles.PendingRequest` (its `prefix_hashes`; cost: the
tokens it makes the replica run, `_llm_work`). The rules are `deployments.core.affinity`'s; the loads
are the tokens this router has in flight on each replica (routed, not completed), an item the
replica already holds (`HolderRecord`) counting none. Anything else (a `stats` call) is routed
by power-of-two choices.

Serve takes the first rank a replica of which has room: the owner (or the prefix's replica)
alone first, then the rest, so a replica whose queue is full never blocks a request.

Serve matches a chosen replica back to its request by the internal request id, which calls made
from one request share: the dispatcher therefore routes a request's items one call at a time
(concurrent siblings would never match, and a router without Serve's FIFO fallback would retry
them forever), and the in-flight record keeps a list per id.
"""

from __future__ import annotations

import logging
import random
from collections import Counter

from ray.serve.request_router import PendingRequest as ServePendingRequest
from ray.serve.request_router import ReplicaID, RequestRouter, RunningReplica

from deployments.core import affinity
from deployments.core.affinity import BoundedLoadRing, HolderRecord, PrefixRecord, capacity, power_of_two
from deployments.core.llm_inputs import PendingRequest
from mmserve.request.media import EncodeItem

logger = logging.getLogger("ray.serve")


class AffinityRequestRouter(RequestRouter):
    def initialize_state(self, epsilon: float, block_size: int):  # `RoutingArgs.deployment_options` passes both
        self._epsilon = epsilon
        self._block_size = block_size
        self._ring: BoundedLoadRing | None = None
        self._record = PrefixRecord()
        self._held = HolderRecord()  # item key -> encoder replicas that got it
        self._loads: Counter = Counter()  # replica id -> tokens in flight from this router
        # internal request id -> [(replica id, tokens)]: calls made from one request share the id
        self._in_flight: dict[str, list[tuple[str, int]]] = {}
        self._rng = random.Random()
        self._metrics = None
        logger.info("affinity routing for %s (epsilon %g)", self._deployment_id, epsilon)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: ServePendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ids = sorted(by_id)
        if not ids:
            return []
        arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        try:
            choice, outcome, prefix_blocks = self._choose(arg, ids)
            self._count(outcome, prefix_blocks * self._block_size if isinstance(arg, PendingRequest) else None)
        except Exception:  # a routing bug must cost affinity, never the request (Serve would retry it forever)
            logger.exception("affinity routing failed; routing this request by load")
            return [candidate_replicas]
        first = by_id[choice]
        return [[first], [r for r in candidate_replicas if r is not first]]

    def _choose(self, arg, ids: list[str]) -> tuple[str, str, int]:
        """(replica id, outcome, prefix blocks the replica likely holds)."""
        loads = {i: self._loads[i] for i in ids}
        if isinstance(arg, list) and arg and isinstance(arg[0], EncodeItem):
            if self._ring is None or self._ring.members != tuple(ids):
                self._ring = BoundedLoadRing(ids)  # churn: rebuilt over the live replicas
            key, cost = arg[0].item.content_hash, sum(item.cost for item in arg)
            holders = self._held.holders(key, ids)
            owner = self._ring.owner(key, loads, cost, self._epsilon, holders)
            if owner in holders:
                return owner, "held", 0
            return owner, "owner" if owner == self._ring.preference(key)[0] else "overflow", 0
        if isinstance(arg, PendingRequest):
            replica, depth = self._record.longest(arg.prefix_hashes, ids)
            cost = self._llm_work(arg, depth)
            if replica is not None and loads[replica] + cost <= capacity(loads, cost, self._epsilon):
                return replica, "prefix_hit", depth
            return power_of_two(ids, loads, self._rng), "overloaded" if replica is not None else "no_prefix", 0
        return power_of_two(ids, loads, self._rng), "other", 0

    def on_request_routed(self, pending_request: ServePendingRequest, replica_id: ReplicaID, result) -> None:
        arg = pending_request.args[0] if pending_request.args else None
        if isinstance(arg, PendingRequest):
            cost = self._llm_work(arg, self._record.longest(arg.prefix_hashes, (replica_id.unique_id,))[1])
            self._record.record(arg.prefix_hashes, replica_id.unique_id)
        elif isinstance(arg, list) and arg and isinstance(arg[0], EncodeItem):
            replica = replica_id.unique_id
            # an item the replica holds is a hit or a dedupe there: no queued work
            cost = sum(item.cost for item in arg if not self._held.holders(item.item.content_hash, (replica,)))
            for item in arg:
                self._held.record(item.item.content_hash, replica)
        else:
            return
        self._in_flight.setdefault(pending_request.metadata.internal_request_id, []).append((replica_id.unique_id, cost))
        self._loads[replica_id.unique_id] += cost

    def _llm_work(self, request: PendingRequest, cached_blocks: int) -> int:
        """Tokens an LLM replica still has to run for `request`: its prompt less the blocks it
        likely holds cached, plus the most it decodes (a request holds a decode slot for all of
        them, so prompt tokens alone would count a long answer as no load)."""
        prompt = len(request.prompt_token_ids)
        return prompt - min(cached_blocks * self._block_size, prompt) + request.sampling.max_tokens

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        calls = self._in_flight.get(internal_request_id, [])
        for i, (replica, cost) in enumerate(calls):
            if replica == replica_id.unique_id:
                del calls[i]
                self._loads[replica] -= cost
                break
        if not calls:
            self._in_flight.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._loads.pop(replica_id.unique_id, None)

    def _count(self, outcome: str, prefix_tokens: int | None) -> None:
        deployment = self._deployment_id.name if self._deployment_id else "?"
        affinity.DECISIONS[(deployment, outcome)] += 1  # (through the module: Serve ships this class by value)
        if self._metrics is None:
            from deployments.serve.metrics import AffinityMetrics

            self._metrics = AffinityMetrics()
        self._metrics.routed.inc(tags={"target": deployment, "outcome": outcome})
        if prefix_tokens is not None:
            self._metrics.prefix_tokens.observe(prefix_tokens)
