"""Admission of a Router replica's requests, from planning to their first token: by the sequences
they start, by the time to first token the work queued ahead of them would cost, fairly among
clients. Ray-free; the core (`request_core.RequestCore`) holds one."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mmserve.errors import QueueFull

WORK_PER_SEQUENCE = 64  # prompt tokens' worth of work a sequence costs beyond its prompt (a short one still counts)
EWMA = 0.2  # weight of the newest sample in `seconds_per_work`
ACTIVE_S = 10.0  # a refused client counts among the active ones this long


@dataclass
class _Client:
    places: int = 0
    work: float = 0.0
    refused_at: float = -math.inf


@dataclass
class Ticket:
    """One request's hold on places (its `n` sequences) and, once planned, on work."""

    client: str
    sequences: int
    work: float = 0.0
    ahead: float = 0.0  # the work pending when it was admitted, its own included
    admitted_at: float | None = None


class Admission:
    """Who may start now, per Router replica; QueueFull (429 + Retry-After / RESOURCE_EXHAUSTED),
    saying which bound, for the others:

    - places: a request holds `n` (its choices) of `max_sequences` (`max_pending_requests`);
    - latency: once planned, its work (`n` x (prompt tokens + `WORK_PER_SEQUENCE`)) is admitted
      while the expected time to its first token, `seconds_per_work` x (the work pending, its own
      included), fits `ttft_budget_s`. `seconds_per_work` is learned from the requests that got
      their first token: the time from their admission over the work pending then (a moving
      average), so it follows what the replicas behind this Router deliver, decoding load included;
    - fairness: a client (the adapters name it: its address) already holding places may hold at
      most its share, 1/k of the places and of the work the budget fits, k the clients holding
      places or refused within `ACTIVE_S`; a client alone has it all, so one client's flood never
      locks the others out.

    A request arriving while nothing is pending is always admitted: an estimate from a busier
    time never locks the replica, and a request larger than the bounds still runs alone."""

    def __init__(self, max_sequences: int, ttft_budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit, self.budget_s, self.clock = max_sequences, ttft_budget_s, clock
        self.held = 0  # places
        self.work = 0.0  # of the admitted requests waiting for their first token
        self.seconds_per_work: float | None = None
        self._clients: dict[str, _Client] = {}

    def check(self, client: str, sequences: int = 1) -> None:
        """QueueFull when `client` may not take `sequences` places now (before its body is read,
        and when it takes them)."""
        if not self.held:
            return
        if self.held + sequences > self.limit:
            self._refuse(client, f"{self.held} sequences wait for their first token (limit {self.limit})")
        mine, share = self._mine(client).places, self._share(client)
        if mine and mine + sequences > max(1, math.floor(self.limit * share)):
            self._refuse(client, f"this client's requests hold {mine} of the {self.limit} places for sequences "
                                 f"waiting for their first token, its share while {round(1 / share)} clients wait")

    @contextlib.contextmanager
    def take(self, client: str, sequences: int) -> Iterator[Ticket]:
        """Places for a request's `sequences`, held until the block ends (its first token, or its failure)."""
        self.check(client, sequences)
        mine = self._clients.setdefault(client, _Client())
        ticket = Ticket(client, sequences)
        mine.places += sequences
        self.held += sequences
        try:
            yield ticket
        finally:
            mine.places -= sequences
            mine.work -= ticket.work
            self.held -= sequences
            self.work -= ticket.work
            if not mine.places and not self._recent(mine):
                self._clients.pop(client, None)

    def admit(self, ticket: Ticket, prompt_tokens: int) -> None:
        """Admit a planned request's work, or QueueFull when the expected time to its first token
        is over the budget (or over its client's share of it)."""
        work = ticket.sequences * (prompt_tokens + WORK_PER_SEQUENCE)
        rate, mine = self.seconds_per_work, self._mine(ticket.client)
        if self.work and rate is not None:
            wait_s = rate * (self.work + work)
            if wait_s > self.budget_s:
                self._refuse(ticket.client, f"the work queued ahead would take ~{wait_s:.1f} s to a first token, "
                                            f"over the budget of {self.budget_s:g} s (ttft_budget_s)")
            share = self._share(ticket.client)
            if mine.work and rate * (mine.work + work) > self.budget_s * share:
                self._refuse(ticket.client, f"this client's requests queue ~{rate * mine.work:.1f} s of work, its "
                                            f"share of the {self.budget_s:g} s budget while {round(1 / share)} "
                                            "clients wait")
        ticket.work = work
        mine.work += work
        self.work += work
        ticket.ahead, ticket.admitted_at = self.work, self.clock()

    def started(self, ticket: Ticket) -> None:
        """The request's first token is back: one sample of `seconds_per_work`."""
        if ticket.admitted_at is None or not ticket.ahead:
            return
        sample = (self.clock() - ticket.admitted_at) / ticket.ahead
        rate = self.seconds_per_work
        self.seconds_per_work = sample if rate is None else (1 - EWMA) * rate + EWMA * sample
        ticket.admitted_at = None

    def _mine(self, client: str) -> _Client:
        return self._clients.get(client) or _Client()

    def _recent(self, state: _Client) -> bool:
        return self.clock() - state.refused_at < ACTIVE_S

    def _share(self, client: str) -> float:
        """1 / the clients holding places or refused lately, `client` among them."""
        active = {c for c, state in self._clients.items() if state.places or self._recent(state)} | {client}
        return 1 / len(active)

    def _refuse(self, client: str, why: str):
        self._clients.setdefault(client, _Client()).refused_at = self.clock()
        for name in [c for c, state in self._clients.items() if not state.places and not self._recent(state)]:
            del self._clients[name]
        raise QueueFull(why)
