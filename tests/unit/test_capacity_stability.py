"""The "keeps up" test of the planners' goodput (`mmserve.capacity.goodput.stability`): a rate is
sustainable when the backlog stops growing once the queue has filled. Judged on synthetic M/D/c
traces (c servers, FIFO, a fixed service time) at two run lengths four times apart."""

from __future__ import annotations

import heapq
import random

import pytest

from mmserve.capacity.goodput import GROWTH, stability
from mmserve.capacity.routing import _contents, contents, typical_workload


def mdc(load: float, servers: int, per_server: int, service: float = 1.0, seed: int = 0):
    """Poisson arrivals at `load` x the capacity (servers / service), each served `service` seconds
    by the first server free: (arrivals, finishes)."""
    rng, rate = random.Random(seed), load * servers / service
    free, t, arrivals, finishes = [0.0] * servers, 0.0, [], []
    for _ in range(servers * per_server):
        t += rng.expovariate(rate)
        start = max(t, heapq.heappop(free))
        heapq.heappush(free, start + service)
        arrivals.append(t)
        finishes.append(start + service)
    return arrivals, finishes


@pytest.mark.parametrize("per_server", [30, 120])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_stable_queue_keeps_up_and_an_overloaded_one_does_not_at_either_run_length(per_server, seed):
    for servers in (8, 64):
        arrivals, finishes = mdc(0.8, servers, per_server, seed=seed)
        under = stability(arrivals, finishes, start=arrivals[len(arrivals) // 2])  # half warms up, as the planner
        assert under.judged and under.keeps_up, (servers, under)
        arrivals, finishes = mdc(1.2, servers, per_server, seed=seed)
        over = stability(arrivals, finishes, start=arrivals[len(arrivals) // 2])
        assert not over.keeps_up, (servers, over)
        # the backlog grows at the rate less the capacity (1 - 1/1.2 = 0.17 of the rate), give or
        # take the arrivals' noise (a random walk: 0.13-0.26 over these seeds at 8 servers)
        assert over.growth > 2 * GROWTH, (servers, over)


def test_a_run_barely_longer_than_one_service_is_too_short_to_judge():
    # the routing planner's case at 30 requests per GPU: a measured window of about one latency,
    # in which a filling queue cannot be told from a growing one
    for per_server, judged in ((2, False), (30, True), (120, True)):
        arrivals, finishes = mdc(0.8, 16, per_server, service=2.0)
        verdict = stability(arrivals, finishes, start=arrivals[len(arrivals) // 2])
        assert verdict.judged == judged, (per_server, verdict)
        if judged:
            assert verdict.keeps_up and abs(verdict.growth) < GROWTH


def test_a_run_of_arrivals_alone_grows_by_the_whole_rate():
    arrivals = [i * 0.01 for i in range(1000)]
    never = stability(arrivals, [float("inf")] * 1000)
    assert never.growth == pytest.approx(1.0, abs=0.01) and not never.keeps_up


def test_extended_content_begins_with_the_shorter_runs_content():
    workload = typical_workload()
    assert _contents(workload, 400, 0)[:200] == contents(workload, 200, 0)
