"""`AffinityRequestRouter`: affinity routing inside Serve's own request-router API.

Serve instantiates it in each caller (our Router deployment's replicas) for the Encoder and LLM
deployments (`request_router_config`), so routing stays inside Serve's replica tracking, queue
probing, backoff and autoscaling. It reads the key from the call's argument, which already holds
it: an `Encoder.encode` call carries its items (content hash, cost in tokens; the key is the
first item's: the dispatcher sends an item seen before alone, cold items in size-balanced
groups), an `LLM.generate` call our `handles.PendingRequest` (its `prefix_hashes`; cost: the
tokens it makes the replica run). The decisions and the loads are `mmserve.routing.affinity`'s
`AffinityChooser` (Ray-free; the capacity planner runs the same): the tokens this router has in
flight on each replica (routed, not completed), an item the replica already holds counting none.
Anything else (a `stats` call) is routed by power-of-two choices. A request under a LoRA adapter
(Serve's multiplexed model id) is routed among the replicas that report the adapter, if any, then
to the others.

Serve takes the first rank a replica of which has room: the owner (or the prefix's replica)
alone first, then the rest, so a replica whose queue is full never blocks a request.

Serve matches a chosen replica back to its request by the internal request id, which calls made
from one request share: the dispatcher therefore routes a request's items one call at a time
(concurrent siblings would never match, and a router without Serve's FIFO fallback would retry
them forever), and the in-flight record keeps a list per id.
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest as ServePendingRequest
from ray.serve.request_router import ReplicaID, RequestRouter, RunningReplica

from deployments.core.llm_inputs import PendingRequest
from mmserve.inputs.media import EncodeItem
from mmserve.routing import affinity
from mmserve.routing.affinity import AffinityChooser, power_of_two

logger = logging.getLogger("ray.serve")


def _items(arg) -> list[tuple[str, int]] | None:
    """An `Encoder.encode` call's items as (content hash, cost), or None for another call."""
    encode = isinstance(arg, list) and arg and isinstance(arg[0], EncodeItem)
    return [(item.item.content_hash, item.cost) for item in arg] if encode else None


def multiplexed_holders(model_id: str, loaded: dict[str, set[str]]) -> list[str]:
    """The replicas (sorted ids) that report `model_id` (a LoRA adapter: Serve's multiplexed model
    id) among their `loaded` ones; [] for none or no id."""
    return sorted(i for i, ids in loaded.items() if model_id and model_id in ids)


def ranks(choice: str, holders: list[str], ids: list[str]) -> list[list[str]]:
    """Serve's ranks of replicas: the affinity choice alone, then the other `holders` of the
    request's adapter, then the rest (each rank non-empty)."""
    others = [i for i in holders if i != choice]
    rest = [i for i in ids if i != choice and i not in holders]
    return [rank for rank in ([choice], others, rest) if rank]


class AffinityRequestRouter(RequestRouter):
    def initialize_state(self, epsilon: float, block_size: int):  # `RoutingArgs.deployment_options` passes both
        self._rules = AffinityChooser(epsilon, block_size)
        # internal request id -> [(replica id, tokens)]: calls made from one request share the id
        self._in_flight: dict[str, list[tuple[str, int]]] = {}
        self._metrics = None
        logger.info("affinity routing for %s (epsilon %g)", self._deployment_id, epsilon)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: ServePendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ids = sorted(by_id)
        if not ids:
            return []
        arg = pending_request.args[0] if pending_request is not None and pending_request.args else None
        model_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        try:
            holders = multiplexed_holders(model_id, {i: r.multiplexed_model_ids for i, r in by_id.items()})
            choice, outcome, prefix_blocks = self._choose(arg, holders or ids)
            self._count(outcome, prefix_blocks * self._rules.block_size if isinstance(arg, PendingRequest) else None)
        except Exception:  # a routing bug must cost affinity, never the request (Serve would retry it forever)
            logger.exception("affinity routing failed; routing this request by load")
            return [candidate_replicas]
        return [[by_id[i] for i in rank] for rank in ranks(choice, holders, ids)]

    def _choose(self, arg, ids: list[str]) -> tuple[str, str, int]:
        """(replica id, outcome, prefix blocks the replica likely holds)."""
        if (items := _items(arg)) is not None:
            return *self._rules.choose_encoder(items, ids), 0
        if isinstance(arg, PendingRequest):
            return self._rules.choose_llm(arg.prefix_hashes, len(arg.prompt_token_ids), arg.sampling.max_tokens, ids)
        return power_of_two(ids, {i: self._rules.loads[i] for i in ids}, self._rules.rng), "other", 0

    def on_request_routed(self, pending_request: ServePendingRequest, replica_id: ReplicaID, result) -> None:
        arg = pending_request.args[0] if pending_request.args else None
        replica = replica_id.unique_id
        if isinstance(arg, PendingRequest):
            prompt, max_tokens = len(arg.prompt_token_ids), arg.sampling.max_tokens
            cost = self._rules.llm_routed(arg.prefix_hashes, prompt, max_tokens, replica)
        elif (items := _items(arg)) is not None:
            cost = self._rules.encoder_routed(items, replica)
        else:
            return
        self._in_flight.setdefault(pending_request.metadata.internal_request_id, []).append((replica, cost))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        calls = self._in_flight.get(internal_request_id, [])
        for i, (replica, cost) in enumerate(calls):
            if replica == replica_id.unique_id:
                del calls[i]
                self._rules.completed(replica, cost)
                break
        if not calls:
            self._in_flight.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._rules.loads.pop(replica_id.unique_id, None)

    def _count(self, outcome: str, prefix_tokens: int | None) -> None:
        deployment = self._deployment_id.name if self._deployment_id else "?"
        affinity.DECISIONS[(deployment, outcome)] += 1  # (through the module: Serve ships this class by value)
        if self._metrics is None:
            from deployments.serve.metrics import AffinityMetrics

            self._metrics = AffinityMetrics()
        self._metrics.routed.inc(tags={"target": deployment, "outcome": outcome})
        if prefix_tokens is not None:
            self._metrics.prefix_tokens.observe(prefix_tokens)
