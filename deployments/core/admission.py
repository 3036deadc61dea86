"""Admission of a Router replica's requests, from the end of their reading to their first token: by
the sequences they start, by the time to first token the work queued ahead of them would cost,
fairly among clients. Ray-free; the core (`request_core.RequestCore`) holds one."""

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


@dataclass(eq=False)
class Ticket:
    """One request's hold on places (its `n` sequences) and on work (guessed until it is planned)."""

    client: str
    sequences: int
    work: float = 0.0
    ahead: float = 0.0  # the work pending when it was admitted, its own included
    admitted_at: float | None = None


class Admission:
    """Who may start now, per Router replica; QueueFull (429 + Retry-After / RESOURCE_EXHAUSTED),
    saying which bound, for the others. Checked before a request's body is read and again when it
    takes its places (read, checked, its media loaded), then once more when it is planned:

    - places: a request holds `n` (its choices) of `max_sequences` (`max_pending_requests`);
    - latency: its work (`n` x (prompt tokens + `WORK_PER_SEQUENCE`); before it is planned, `n` x
      the mean work of a sequence lately) is admitted while the expected time to its first token,
      seconds per work x (the work pending, its own included), fits `ttft_budget_s`. The seconds per
      work are learned from the requests that got their first token (the time from their admission
      over the work pending then, a moving average), so they follow what the replicas behind this
      Router deliver, decoding load included; and while a burst's first requests still wait, each
      one's wait so far over the work that was pending at its admission is a lower bound on them,
      so that a burst is shed from its start, not once its first tokens teach the pace;
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
        self.seconds_per_work: float | None = None  # learned from first tokens (`started`)
        self.work_per_sequence = WORK_PER_SEQUENCE  # of the planned requests lately: the guess before planning
        self._clients: dict[str, _Client] = {}
        self._waiting: set[Ticket] = set()

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
        self._check_wait(client, sequences * self.work_per_sequence)

    @contextlib.contextmanager
    def take(self, client: str, sequences: int) -> Iterator[Ticket]:
        """Places for a request's `sequences` and its guessed work, held until the block ends (its
        first token, or its failure)."""
        self.check(client, sequences)
        mine = self._clients.setdefault(client, _Client())
        ticket = Ticket(client, sequences)
        mine.places += sequences
        self.held += sequences
        self._hold(ticket, sequences * self.work_per_sequence)
        ticket.admitted_at = self.clock()
        self._waiting.add(ticket)
        try:
            yield ticket
        finally:
            mine.places -= sequences
            self.held -= sequences
            self._hold(ticket, 0.0)
            self._waiting.discard(ticket)
            if not mine.places and not self._recent(mine):
                self._clients.pop(client, None)

    def admit(self, ticket: Ticket, prompt_tokens: int) -> None:
        """Admit a planned request's work in place of its guess, or QueueFull when the expected time
        to its first token is over the budget (or over its client's share of it)."""
        work = ticket.sequences * (prompt_tokens + WORK_PER_SEQUENCE)
        self._hold(ticket, 0.0)
        self._check_wait(ticket.client, work)
        self._hold(ticket, work)
        # whole tokens: the sums of work stay exact, and back to 0 when nothing is pending
        self.work_per_sequence = round((1 - EWMA) * self.work_per_sequence + EWMA * work / ticket.sequences)

    def started(self, ticket: Ticket) -> None:
        """The request's first token is back: one sample of `seconds_per_work`."""
        self._waiting.discard(ticket)
        if ticket.admitted_at is None or not ticket.ahead:
            return
        sample = (self.clock() - ticket.admitted_at) / ticket.ahead
        rate = self.seconds_per_work
        self.seconds_per_work = sample if rate is None else (1 - EWMA) * rate + EWMA * sample
        ticket.admitted_at = None

    def rate(self) -> float | None:
        """Seconds per work now: the learned pace, or more while a waiting request has already waited
        longer than that pace gives the work pending at its admission (None: nothing to go by yet)."""
        now = self.clock()
        waited = [(now - t.admitted_at) / t.ahead for t in self._waiting if t.admitted_at is not None and t.ahead]
        if self.seconds_per_work is None and not waited:
            return None
        return max([self.seconds_per_work or 0.0, *waited])

    def _hold(self, ticket: Ticket, work: float) -> None:
        """`ticket`'s work pending becomes `work` (0: none)."""
        delta, mine = work - ticket.work, self._clients.get(ticket.client)
        self.work += delta
        if mine is not None:
            mine.work += delta
        ticket.work = work
        if work:
            ticket.ahead = self.work

    def _check_wait(self, client: str, work: float) -> None:
        """QueueFull when `work` more would wait past the budget, or past `client`'s share of it."""
        rate, mine = self.rate(), self._mine(client)
        if not self.work or rate is None:
            return
        wait_s = rate * (self.work + work)
        if wait_s > self.budget_s:
            self._refuse(client, f"the work queued ahead would take ~{wait_s:.1f} s to a first token, "
                                 f"over the budget of {self.budget_s:g} s (ttft_budget_s)")
        share = self._share(client)
        if mine.work and rate * (mine.work + work) > self.budget_s * share:
            self._refuse(client, f"this client's requests queue ~{rate * mine.work:.1f} s of work, its "
                                 f"share of the {self.budget_s:g} s budget while {round(1 / share)} clients wait")

    def _mine(self, client: str) -> _Client:
        return self._clients.get(client) or _Client()

    def _recent(self, state: _Client) -> bool:
        return self.clock() - state.refused_at < ACTIVE_S

    def _share(self, client: str) -> float:
        """1 / the clients holding places or refused lately, `client` among them."""
        return 1 / len({c for c, state in self._clients.items() if state.places or self._recent(state)} | {client})

    def _refuse(self, client: str, why: str):
        self._clients.setdefault(client, _Client()).refused_at = self.clock()
        for name in [c for c, state in self._clients.items() if not state.places and not self._recent(state)]:
            del self._clients[name]
        raise QueueFull(why)
