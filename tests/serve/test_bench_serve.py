"""The serving benchmark's pure parts: seeded arrivals and request mix, and metrics from a trace."""

from __future__ import annotations

import statistics

import pytest

from mmserve.loadgen.dataset import DatasetConfig, ResolutionBucket, arrival_times, generate_requests
from mmserve.loadgen.metrics import SLO, RequestRecord, compute_metrics, percentile


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_cv_one():
    gaps = _gaps(arrival_times(20_000, request_rate=4.0, seed=7))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)


def test_gamma_arrivals_have_cv_one_over_sqrt_burstiness():
    gaps = _gaps(arrival_times(20_000, request_rate=2.0, seed=3, burstiness=0.25))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(2.0, rel=0.07)


def test_arrivals_are_seeded_and_infinite_rate_sends_at_once():
    assert arrival_times(50, 3.0, seed=1) == arrival_times(50, 3.0, seed=1)
    assert arrival_times(50, 3.0, seed=1) != arrival_times(50, 3.0, seed=2)
    assert arrival_times(5, float("inf"), seed=1) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0, seed=1)


def test_dataset_mix_matches_its_shares():
    config = DatasetConfig(
        buckets=(ResolutionBucket(64, 64, 0.6), ResolutionBucket(128, 96, 0.4)),
        max_images=3, text_only_share=0.25, repeat_share=0.2, input_len=40, output_len=10, range_ratio=0.5,
    )
    requests = generate_requests(config, 4000, seed=11)
    assert generate_requests(config, 50, seed=11) == requests[:50]
    text_only = sum(1 for r in requests if not r.images) / len(requests)
    assert text_only == pytest.approx(0.25, abs=0.02)
    with_images = [r for r in requests if r.images]
    counts = [len(r.images) for r in with_images]
    assert set(counts) == {1, 2, 3}
    assert statistics.fmean(counts) == pytest.approx(2.0, abs=0.05)
    images = [image for r in with_images for image in r.images]
    seen: set[int] = set()
    repeats = 0
    for image in images:
        repeats += image.seed in seen
        seen.add(image.seed)
    assert repeats / len(images) == pytest.approx(0.2, abs=0.02)
    fresh = {image.seed: image for image in images}.values()
    small = sum(1 for image in fresh if (image.height, image.width) == (64, 64)) / len(fresh)
    assert small == pytest.approx(0.6, abs=0.03)
    assert {(i.height, i.width) for i in fresh} == {(64, 64), (128, 96)}
    assert min(r.prompt_words for r in requests) == 20 and max(r.prompt_words for r in requests) == 60
    assert statistics.fmean(r.max_tokens for r in requests) == pytest.approx(10, abs=0.3)


def _trace() -> list[RequestRecord]:
    return [
        # TTFT 0.1, tokens at 0.1 0.3 0.4: TPOT (0.4-0.1)/2 = 0.15, ITL 0.2 0.1, E2E 0.4
        RequestRecord(send_time=0.0, end_time=0.4, ok=True, token_times=(0.1, 0.3, 0.4), input_tokens=10),
        # TTFT 0.5, tokens at 1.5 1.6: TPOT 0.1, ITL 0.1, E2E 0.6
        RequestRecord(send_time=1.0, end_time=1.6, ok=True, token_times=(1.5, 1.6), input_tokens=20),
        # one token: TTFT 0.2, no TPOT, E2E 0.2
        RequestRecord(send_time=1.5, end_time=1.7, ok=True, token_times=(1.7,), input_tokens=5),
        RequestRecord(send_time=1.8, end_time=1.81, ok=False, status="429"),
        RequestRecord(send_time=1.9, end_time=2.0, ok=False, status="500"),
    ]


def test_metrics_from_a_trace_equal_hand_computed_values():
    m = compute_metrics(_trace())
    assert m["duration"] == pytest.approx(2.0)
    assert (m["completed"], m["failed"], m["rejected_429"]) == (3, 2, 1)
    assert m["total_output_tokens"] == 6 and m["total_input_tokens"] == 35
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["mean_ttft_ms"] == pytest.approx((100 + 500 + 200) / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 300 * 0.98)
    assert m["mean_tpot_ms"] == pytest.approx(125)
    assert m["mean_itl_ms"] == pytest.approx((200 + 100 + 100) / 3)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx((400 + 600 + 200) / 3)
    assert m["p50_e2el_ms"] == pytest.approx(400)


def test_goodput_counts_requests_meeting_every_slo_and_never_failures():
    trace = _trace()
    assert compute_metrics(trace)["request_goodput"] == pytest.approx(1.5)
    # TTFT <= 300 ms keeps requests 1 and 3; TPOT <= 120 ms then drops request 1 (150 ms)
    assert compute_metrics(trace, SLO.parse("ttft:300"))["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics(trace, SLO.parse("ttft:300 tpot:120"))["request_goodput"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        SLO.parse("latency:5")


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([], 99) == 0.0


def test_the_load_runs_over_http_and_grpc_against_a_served_app(serve_urls, grpc_target):
    """The load generator's two transports against the session's real app: every request streams
    exactly its max_tokens (ignore_eos), a token at a time, over both; over HTTP each record has
    the server's stage times."""
    import asyncio

    from mmserve.loadgen.client import run_load

    config = DatasetConfig(buckets=(ResolutionBucket(56, 56, 1.0),), max_images=2, text_only_share=0.25,
                           repeat_share=0.3, input_len=12, output_len=4, range_ratio=0.0)
    specs = generate_requests(config, 6, seed=5)
    assert any(s.images for s in specs) and any(not s.images for s in specs)
    zeros = [0.0] * len(specs)
    http = asyncio.run(run_load(serve_urls["qwen2_vl"], "qwen2_vl", specs, zeros, concurrency=3))
    grpc = asyncio.run(run_load(grpc_target, "qwen2_vl", specs, zeros, concurrency=3, transport="grpc",
                                application="qwen2_vl"))
    for records in (http, grpc):
        assert [r.status for r in records] == ["200"] * len(specs)
        assert [r.output_tokens for r in records] == [s.max_tokens for s in specs]
    stages = {"router_ms", "embeddings_ms", "prefill_queue_ms", "prefill_ms", "decode_ms",
              "encode_queue_ms", "encode_ms", "embedding_transfer_ms"}
    assert all(set(r.stage_ms) == stages for r in http + grpc)  # each request's stage times, for --result-json
    row = http[0].as_json(http[0].send_time)
    assert row["send_s"] == 0 and row["stage_ms"] == http[0].stage_ms and row["e2e_ms"] >= row["ttft_ms"] > 0
    refused = asyncio.run(run_load(grpc_target, "no-such-model", specs[:1], [0.0], transport="grpc",
                                   application="qwen2_vl"))
    assert refused[0].status == "INVALID_ARGUMENT" and not refused[0].ok
