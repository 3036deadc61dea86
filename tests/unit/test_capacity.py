"""The capacity planner (`mmserve plan`, mmserve/capacity/simulate.py): its event engine against closed-form
queueing, its determinism, and its command line."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from mmserve.capacity.cli import main
from mmserve.capacity.events import BatchStation, SharedCores, Simulator
from mmserve.capacity.estimate import capacity
from mmserve.capacity.goodput import HEADROOM, goodput, recommend
from mmserve.capacity.inputs import SLO, Autoscaling, Profile, Workload, load_profile, with_transfer_rates
from mmserve.capacity.simulate import percentile, simulate

ROOT = Path(__file__).resolve().parents[2]
HAND = "a100-qwen3-vl-4b"  # the bundled profile, by name


def erlang_c_wait(arrival: float, service: float, servers: int) -> float:
    """Mean wait in queue of an M/M/c queue (Erlang C)."""
    load = arrival / service
    rho = load / servers
    tail = load ** servers / math.factorial(servers) / (1 - rho)
    p_wait = tail / (sum(load ** k / math.factorial(k) for k in range(servers)) + tail)
    return p_wait / (servers * service - arrival)


@pytest.mark.parametrize("servers, arrival", [(1, 0.7), (3, 2.4)])
def test_the_engine_reproduces_an_mmc_queue(servers, arrival):
    rng, sim = random.Random(1), Simulator()
    station = BatchStation(sim, servers, lambda cost, jobs: rng.expovariate(1.0), max_jobs=1)
    waits, t = [], 0.0
    for _ in range(60_000):
        t += rng.expovariate(arrival)
        sim.at(t, lambda sent=t: station.submit(1, lambda: waits.append(sim.now - sent)))
    sim.run()
    mean_wait = sum(waits) / len(waits) - 1.0  # time in system less the mean service time (1)
    assert mean_wait == pytest.approx(erlang_c_wait(arrival, 1.0, servers), rel=0.08)
    assert station.busy_seconds / (servers * sim.now) == pytest.approx(arrival / servers, rel=0.03)


def test_a_station_batches_the_queue_prefix_within_its_budget():
    sim, batches = Simulator(), []
    station = BatchStation(sim, 1, lambda cost, jobs: batches.append((cost, jobs)) or 1.0, max_cost=10)
    for cost in (4, 4, 4, 8, 1):
        station.submit(cost, lambda: None)
    sim.run()
    assert batches == [(4, 1), (8, 2), (9, 2)]  # the first alone (the server was free), then prefixes within 10


def test_shared_cores_run_a_job_alone_at_full_speed_and_share_past_their_capacity():
    for capacity, jobs, ends in ((1.0, 1, [2.0]), (1.0, 2, [4.0, 4.0]), (2.0, 2, [2.0, 2.0]), (1.5, 3, [4.0] * 3)):
        sim, done = Simulator(), []
        cores = SharedCores(sim, capacity)
        for _ in range(jobs):
            cores.run(2.0, lambda: done.append(sim.now))
        sim.run()
        assert done == pytest.approx(ends), (capacity, jobs)
    sim, done = Simulator(), {}
    cores = SharedCores(sim, 1.0)
    cores.run(2.0, lambda: done.setdefault("long", sim.now))
    sim.at(1.0, lambda: cores.run(0.5, lambda: done.setdefault("short", sim.now)))  # halves the long one's speed
    sim.run()
    assert done == pytest.approx({"short": 2.0, "long": 2.5})


def test_admission_refuses_past_the_pending_bound_and_bounds_ttft():
    burst = [(0.0, 2)] * 60
    free = simulate(PROFILE, WORKLOAD, 1, 1, arrivals=burst)
    bounded = simulate(replace(PROFILE, max_pending_requests=8), WORKLOAD, 1, 1, arrivals=burst)
    assert free.refused_share == 0 and bounded.refused_share == pytest.approx(52 / 60)
    assert bounded.ttft_p99_s < free.ttft_p99_s


def test_a_refused_request_costs_the_shared_box_its_refusal_work():
    # A's prefill step is 1 s of the box; B, refused at 0.1 s (A waits for its first token), costs
    # 0.5 s of the box: both at half speed until B's refusal is done (1.1 s), A alone after (1.5 s)
    profile = Profile(source="test", router_s=0.0, step_s=1.0, prefill_token_s=0.0, decode_seq_s=0.0,
                      shared_capacity=1.0, max_pending_requests=1, refuse_s=0.5)
    workload = Workload(rate=1.0, images=(0, 0), text_tokens=1, output_tokens=1)
    result = simulate(profile, workload, 1, 1, arrivals=[(0.0, 0), (0.1, 0)])
    free = simulate(replace(profile, refuse_s=0.0), workload, 1, 1, arrivals=[(0.0, 0), (0.1, 0)])
    assert result.refused_share == free.refused_share == 0.5
    assert result.ttft_p50_s == pytest.approx(1.5) and free.ttft_p50_s == pytest.approx(1.0)


def test_the_refusal_cost_is_fitted_on_a_run_past_the_admission_bound():
    from mmserve.capacity.fit import fit_refuse_cost, predicted

    profile = Profile(source="test", router_s=0.01, step_s=0.02, prefill_token_s=0.0, decode_seq_s=0.0,
                      shared_capacity=1.0, max_pending_requests=2)
    shape = {"image_tokens": 1, "text_tokens": 1, "output_tokens": 1}
    arrivals = [{"send_s": k * 0.005, "images": 0} for k in range(400)]  # 200/s against ~30/s served

    def run_of(cost: float) -> list[dict]:  # a "real" run: the model itself with a known cost
        result = predicted(replace(profile, refuse_s=cost), shape, arrivals, 1, 1)
        span = len(arrivals) * 0.005
        served = round(result["throughput"] * span)
        return [{**a, "ttft_ms": 1.0 if k < served else None, "e2e_ms": (span - a["send_s"]) * 1000 if k < served
                 else 0.0} for k, a in enumerate(arrivals)]

    assert fit_refuse_cost(profile, shape, run_of(0.0), 1, 1) == 0.0
    assert fit_refuse_cost(profile, shape, run_of(0.004), 1, 1) == pytest.approx(0.004, rel=0.25)


def test_a_colocated_replica_encodes_beside_its_steps_on_one_device():
    # A: encoded alone (1 s), prefilled (0.1 s), first token at 1.1; B arrives then: its 1 s encode
    # shares the device with A's ten 0.1 s decode steps, so both run at half speed for 2 s
    profile = Profile(source="test", router_s=0.0, encode_batch_s=1.0, encode_token_s=0.0, step_s=0.1,
                      prefill_token_s=0.0, decode_seq_s=0.0)
    workload = Workload(rate=1.0, image_tokens=10, text_tokens=5, output_tokens=11)
    result = simulate(profile, workload, 0, 1, arrivals=[(0.0, 1), (1.1, 1)])
    assert result.ttft_p50_s == pytest.approx(1.1) and result.ttft_p99_s == pytest.approx(2.1)  # B: 2 s + its prefill
    assert result.tpot_p99_s == pytest.approx(0.2)  # A's steps, at half speed while B encodes


def test_a_colocated_replica_encoding_inside_its_step_runs_one_at_a_time():
    # as above, vLLM's way: A's first decode step (1.1-1.2), then B's 1 s encode alone (1.2-2.2) while
    # A's next step waits, then that step, then A's step with B's prefill (first token at 2.4); A's
    # ten steps end at 3.1
    profile = Profile(source="test", router_s=0.0, encode_batch_s=1.0, encode_token_s=0.0, step_s=0.1,
                      prefill_token_s=0.0, decode_seq_s=0.0, colocated_encoder="in_step")
    workload = Workload(rate=1.0, image_tokens=10, text_tokens=5, output_tokens=11)
    result = simulate(profile, workload, 0, 1, arrivals=[(0.0, 1), (1.1, 1)])
    assert result.ttft_p50_s == pytest.approx(1.1) and result.ttft_p99_s == pytest.approx(1.3)
    assert result.tpot_p99_s == pytest.approx(0.2)  # the same mean TPOT as beside: one 1 s wait, not ten slow steps
    with pytest.raises(ValueError, match="colocated_encoder"):  # refused where the profile is made
        replace(profile, colocated_encoder="inside")


def test_on_a_shared_box_the_router_takes_the_cores_too():
    profile = Profile(source="test", router_s=1.0, encode_batch_s=0.0, encode_token_s=0.0, step_s=0.1,
                      prefill_token_s=0.0, decode_seq_s=0.0, shared_capacity=1.0)
    workload = Workload(rate=1.0, images=(0, 0), text_tokens=5, output_tokens=11)
    # A routed alone (1 s), first token at 1.1; B's routing (from 1.1) halves A's decode steps
    result = simulate(profile, workload, 1, 1, arrivals=[(0.0, 0), (1.1, 0)])
    assert result.ttft_p50_s == pytest.approx(1.1) and result.tpot_p99_s == pytest.approx(0.2)


def test_a_full_kv_cache_preempts_the_youngest_and_every_request_still_finishes():
    profile = Profile(source="test", router_s=0.0, step_s=0.1, prefill_token_s=0.0, decode_seq_s=0.0, kv_tokens=20)
    workload = Workload(rate=1.0, images=(0, 0), text_tokens=10, output_tokens=5)
    # A prefills alone (first token at 0.1); B's prompt fits beside A's, but A's decodes then need
    # its room: B is preempted whenever it got some, and prefills whole once A is done (0.5)
    result = simulate(profile, workload, 1, 1, arrivals=[(0.0, 0), (0.0, 0)])
    unbounded = simulate(replace(profile, kv_tokens=None), workload, 1, 1, arrivals=[(0.0, 0), (0.0, 0)])
    assert result.ttft_p50_s == pytest.approx(0.1) and result.ttft_p99_s == pytest.approx(0.6)
    assert result.refused_share == 0.0 and result.preemptions >= 1
    assert unbounded.ttft_p99_s == pytest.approx(0.2) and unbounded.preemptions == 0
    too_long = simulate(replace(profile, kv_tokens=14), workload, 1, 1, arrivals=[(0.0, 0), (0.5, 0)])
    assert too_long.refused_share == 1.0 and too_long.throughput == 0.0  # 10 + 5 tokens never fit in 14


def _burst_then_quiet() -> list[tuple[float, int]]:
    burst = [(k / 15, 1) for k in range(15 * 40)]  # 15 images/s for 40 s: one encoder does 10/s
    return burst + [(40 + k, 1) for k in range(60)]  # then one a second for a minute


def test_the_encoder_pool_autoscales_after_its_delays_and_start_time():
    profile = Profile(source="test", router_s=0.0, encode_batch_s=0.1, encode_token_s=0.0, max_batch_tokens=1,
                      step_s=0.001, prefill_token_s=0.0, decode_seq_s=0.0)
    workload = Workload(rate=1.0, image_tokens=1, text_tokens=4, output_tokens=2)

    def run(**scaling):
        spec = Autoscaling(**{**dict(min_replicas=1, max_replicas=4, target_per_replica=2.0, upscale_delay_s=5.0,
                                     downscale_delay_s=10.0, start_s=10.0), **scaling})
        return simulate(profile, workload, 1, 1, arrivals=_burst_then_quiet(), encoder_scaling=spec)

    fixed = simulate(profile, workload, 1, 1, arrivals=_burst_then_quiet())
    scaled, slow, no_downscale = run(), run(start_s=30.0), run(downscale_delay_s=1000.0)
    assert fixed.peak_encoders == 1 and scaled.peak_encoders > 1
    assert 1.0 < scaled.mean_encoders < scaled.peak_encoders
    assert scaled.ttft_p99_s < slow.ttft_p99_s < fixed.ttft_p99_s  # later replicas: a longer queue
    assert scaled.mean_encoders < no_downscale.mean_encoders  # the quiet minute gives replicas back
    with pytest.raises(ValueError, match="min_replicas"):
        Autoscaling(min_replicas=3, max_replicas=2, target_per_replica=1.0)


def test_the_llm_pool_autoscales_on_requests_in_flight():

    profile = Profile(source="test", router_s=0.0, step_s=0.05, prefill_token_s=0.0, decode_seq_s=0.0,
                      max_num_seqs=2)
    workload = Workload(rate=1.0, images=(0, 0), text_tokens=4, output_tokens=4)
    spec = Autoscaling(min_replicas=1, max_replicas=3, target_per_replica=2.0, upscale_delay_s=2.0, start_s=5.0)
    arrivals = [(k / 15, 0) for k in range(15 * 30)]  # 15/s; one replica does 2 sequences / 0.2 s = 10/s
    fixed = simulate(profile, workload, 1, 1, arrivals=arrivals)
    scaled = simulate(profile, workload, 1, 1, arrivals=arrivals, llm_scaling=spec)
    assert scaled.peak_llms > 1 and scaled.ttft_p99_s < fixed.ttft_p99_s and scaled.throughput > fixed.throughput


def _only_encoding(**fields) -> Profile:
    """A profile whose only costs are the ones given (seconds)."""
    return Profile(**{**dict(source="test", router_s=0.0, encode_batch_s=0.0, encode_token_s=0.0, step_s=0.0,
                             prefill_token_s=0.0, decode_seq_s=0.0, max_batch_tokens=1 << 20), **fields})


def test_a_large_request_is_spread_over_the_encoders_and_a_small_one_stays_one_call():
    profile = _only_encoding(encode_token_s=1e-3)  # TTFT is the encode: 1 ms an image token

    def ttft(tokens: int, encoders: int) -> float:
        workload = Workload(rate=1.0, images=(4, 4), image_tokens=tokens, text_tokens=1, output_tokens=1)
        return simulate(profile, workload, encoders, 1, arrivals=[(0.0, 4)]).ttft_p50_s

    assert ttft(64, 1) == ttft(64, 4) == pytest.approx(0.256)  # 4 x 64 tokens: one call, one replica
    # 4 x 2048 tokens: four calls; power of two choices puts no more than two on one of four replicas
    assert ttft(2048, 1) == pytest.approx(8.192)
    assert 2.048 - 1e-9 <= ttft(2048, 4) <= 4.096 + 1e-9


def test_embeddings_cross_the_chosen_transport_at_its_rate_per_byte(tmp_path):
    profile = _only_encoding(step_s=0.01, embedding_token_bytes=1000, object_store_byte_s=1e-6, grpc_byte_s=3e-6)
    workload = Workload(rate=1.0, images=(2, 2), image_tokens=50, text_tokens=1, output_tokens=1)

    def ttft(transport: str, encoders: int = 1, p: Profile = profile) -> float:
        return simulate(p, workload, encoders, 1, arrivals=[(0.0, 2)], transport=transport).ttft_p50_s

    # 2 x 50 tokens x 1000 bytes = 0.1 MB: 0.1 s by the object store, 0.3 s by gRPC, then a 10 ms step
    assert ttft("object_store") == pytest.approx(0.11) and ttft("grpc") == pytest.approx(0.31)
    assert ttft("grpc", encoders=0) == pytest.approx(0.01)  # colocated: nothing crosses
    with pytest.raises(ValueError, match="transport"):
        ttft("rdma")
    measured = tmp_path / "transfer.out"
    measured.write_text('a table\n{"object_store_mb_s_20mb": 500.0, "grpc_mb_s_20mb": 250.0}\n')
    rated = with_transfer_rates(profile, str(measured))
    assert (rated.object_store_byte_s, rated.grpc_byte_s) == pytest.approx((2e-9, 4e-9))
    assert str(measured) in rated.source and rated.source.startswith(profile.source)
    assert ttft("grpc", p=rated) == pytest.approx(0.01 + 100 * 1000 * 4e-9)
    measured.write_text("no summary here\n")
    with pytest.raises(ValueError, match="bench/transfer.py"):
        with_transfer_rates(profile, str(measured))


def test_a_resolution_mix_gives_each_image_its_own_size():
    profile = _only_encoding(encode_token_s=1e-3)
    workload = Workload(rate=1.0, image_mix=((100, 0.8), (1000, 0.2)), text_tokens=1, output_tokens=1)
    alone = [(10.0 * k, 1) for k in range(200)]  # far apart: each TTFT is its own image's encode
    result = simulate(profile, workload, 1, 1, arrivals=alone)
    assert result.ttft_p50_s == pytest.approx(0.1) and result.ttft_p99_s == pytest.approx(1.0)
    assert workload.mean_image_tokens == pytest.approx(280)
    with pytest.raises(ValueError, match="image_mix"):
        Workload(rate=1.0, image_mix=((0, 1.0),))


def test_lengths_spread_by_the_range_ratio():
    profile = _only_encoding(prefill_token_s=1e-3)  # TTFT is the prompt's prefill: 1 ms a token
    workload = Workload(rate=1.0, images=(0, 0), text_tokens=100, output_tokens=1, length_range_ratio=0.5)
    alone = [(10.0 * k, 0) for k in range(200)]
    spread_out = simulate(profile, workload, 1, 1, arrivals=alone)
    fixed = simulate(profile, replace(workload, length_range_ratio=0.0), 1, 1, arrivals=alone)
    assert fixed.ttft_p50_s == pytest.approx(0.1) and fixed.ttft_p99_s == pytest.approx(0.1)
    assert 0.09 <= spread_out.ttft_p50_s <= 0.11 and 0.14 <= spread_out.ttft_p99_s <= 0.15 + 1e-9
    draws = [workload.length(100, random.Random(k)) for k in range(300)]
    assert min(draws) >= 50 and max(draws) <= 150 and len(set(draws)) > 30
    with pytest.raises(ValueError, match="length_range_ratio"):
        Workload(rate=1.0, length_range_ratio=1.0)


def test_percentile_is_the_nearest_rank():
    assert percentile([3, 1, 2, 4], 50) == 2 and percentile([3, 1, 2, 4], 99) == 4 and math.isnan(percentile([], 50))


PROFILE = Profile(source="test", encode_token_s=6e-5, max_batched_tokens=2048, max_num_seqs=128, step_s=0.006,
                  prefill_token_s=5e-5, decode_seq_s=1.5e-4)
WORKLOAD = Workload(rate=8.0, images=(1, 4), image_tokens=400, output_tokens=64)


def test_a_run_is_deterministic_and_keeps_up_below_saturation():
    a = simulate(PROFILE, WORKLOAD, 1, 3, num_requests=400, seed=3)
    assert a == simulate(PROFILE, WORKLOAD, 1, 3, num_requests=400, seed=3)
    assert a != simulate(PROFILE, WORKLOAD, 1, 3, num_requests=400, seed=4)
    assert a.throughput == pytest.approx(WORKLOAD.rate, rel=0.15) and a.ttft_p50_s < a.ttft_p99_s
    assert 0 < a.encoder_utilisation < 1


def test_saturation_caps_throughput_and_grows_ttft():
    slow = simulate(PROFILE, WORKLOAD, 1, 3, num_requests=400)
    flooded = simulate(PROFILE, Workload(rate=200.0, images=(1, 4), image_tokens=400, output_tokens=64), 1, 3,
                       num_requests=400)
    assert flooded.throughput < 0.5 * 200.0 and flooded.ttft_p99_s > 10 * slow.ttft_p99_s


def test_cache_hits_and_encoders_lower_ttft():
    base = simulate(PROFILE, WORKLOAD, 1, 3, num_requests=400)
    hits = simulate(PROFILE, Workload(**{**WORKLOAD.__dict__, "repeat_share": 0.9}), 1, 3, num_requests=400)
    assert hits.ttft_p50_s < base.ttft_p50_s
    assert simulate(PROFILE, WORKLOAD, 2, 3, num_requests=400).ttft_p50_s <= base.ttft_p50_s


def test_goodput_is_the_highest_rate_within_the_slos():
    slo = SLO(ttft_p99_s=2.0, tpot_p99_s=0.05)
    rate = goodput(PROFILE, WORKLOAD, slo, 1, 3, num_requests=300)
    assert rate > 0
    at = simulate(PROFILE, Workload(**{**WORKLOAD.__dict__, "rate": rate}), 1, 3, num_requests=300)
    past = simulate(PROFILE, Workload(**{**WORKLOAD.__dict__, "rate": rate * 1.3}), 1, 3, num_requests=300)
    assert at.ttft_p99_s <= slo.ttft_p99_s and at.tpot_p99_s <= slo.tpot_p99_s
    assert past.ttft_p99_s > slo.ttft_p99_s or past.tpot_p99_s > slo.tpot_p99_s or past.throughput < 0.95 * rate * 1.3


def test_the_recommendation_does_not_move_with_the_seed():
    slo = SLO(ttft_p99_s=1.5, tpot_p99_s=0.1)
    encode_heavy = Workload(rate=1.0, images=(4, 4), image_tokens=1600, output_tokens=16)
    picks = {(r.disaggregated.num_encoders, r.disaggregated.num_llms)
             for r in (recommend(PROFILE, encode_heavy, slo, 4, num_requests=300, seed=s) for s in (0, 1, 2))}
    assert len(picks) == 1
    text_only = recommend(PROFILE, Workload(rate=1.0, images=(0, 0), output_tokens=16), slo, 4, num_requests=300)
    assert text_only.colocated.per_gpu > text_only.disaggregated.per_gpu  # an encoder with nothing to do is waste


@pytest.mark.parametrize("num_encoders, num_llms", [(1, 3), (2, 2), (3, 1), (0, 4)])
def test_the_analytic_capacity_is_what_a_flooded_split_serves(num_encoders, num_llms):
    bound = capacity(PROFILE, WORKLOAD, num_encoders, num_llms)
    flooded = simulate(PROFILE, replace(WORKLOAD, rate=3 * bound), num_encoders, num_llms, num_requests=1000)
    assert 0.9 * bound <= flooded.throughput <= 1.02 * bound


def test_the_default_search_agrees_with_the_full_one(capsys):
    """The default (each goodput searched from the analytic capacity to TOLERANCE, the splits it
    rules out left out) against `--full` (every split, bisected from 1 req/s): the same split, and
    goodputs within 5% (the tolerance, and the noise of p99 TPOT between runs at nearby rates)."""
    args = ["--profile", HAND, "--gpus", "4", "--requests", "200", "--ttft-p99", "2", "--output-tokens", "16"]
    answers = []
    for extra in ([], ["--full"]):
        assert main([*args, *extra]) == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert any(line.startswith("searched from the analytic capacity") for line in out) == (not extra)
        answers.append(json.loads(out[-1])["recommendations"][0])
    fast, full = answers
    assert len(full["candidates"]) == 3 and not full["ruled_out"]
    assert sorted(c["num_encoders"] for c in fast["candidates"] + fast["ruled_out"]) == [1, 2, 3]
    assert all(r["capacity"] * HEADROOM < fast["disaggregated"]["goodput"] for r in fast["ruled_out"])
    for mode in ("disaggregated", "colocated"):
        assert fast[mode]["num_encoders"] == full[mode]["num_encoders"]
        assert fast[mode]["goodput"] == pytest.approx(full[mode]["goodput"], rel=0.05)


def test_plan_prints_its_table_and_ends_with_json(tmp_path, capsys):
    svg = tmp_path / "plan.svg"
    assert main(["--profile", HAND, "--gpus", "4", "8", "--cell", "4", "--requests", "200", "--ttft-p99", "2",
                 "--output-tokens", "16", "--plot", str(svg)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("profile: hand-written")  # a hand-written profile says so in every output
    result = json.loads(out[-1])
    assert [r["gpus"] for r in result["recommendations"]] == [4, 8] and result["profile"].startswith("hand-written")
    four, eight = result["recommendations"]
    assert four["disaggregated"]["num_encoders"] + four["disaggregated"]["num_llms"] == 4
    assert eight["disaggregated"]["goodput"] == pytest.approx(2 * four["disaggregated"]["goodput"])  # two cells
    assert svg.read_text().startswith("<svg") and "hand-written" in svg.read_text()


def test_plan_takes_a_resolution_mix_ranged_lengths_and_measured_transfer_rates(tmp_path, capsys):
    measured = tmp_path / "transfer.out"
    measured.write_text('{"object_store_mb_s_20mb": 800.0, "grpc_mb_s_20mb": 400.0}\n')
    assert main(["--profile", HAND, "--gpus", "4", "--requests", "200", "--ttft-p99", "2", "--output-tokens", "16",
                 "--image-tokens", "256:0.7", "1296:0.3", "--length-range-ratio", "0.25", "--transport", "grpc",
                 "--transfer-json", str(measured)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "bench/transfer.py" in out[0] and "256:0.7 + 1296:0.3" in out[1] and "over grpc" in out[1]
    assert json.loads(out[-1])["recommendations"][0]["disaggregated"]["goodput"] > 0
    with pytest.raises(SystemExit):
        main(["--profile", HAND, "--image-tokens", "256:-1"])


def test_plan_set_changes_a_figure_and_every_output_says_so(capsys):
    args = ["--profile", HAND, "--gpus", "4", "--requests", "200", "--ttft-p99", "2", "--output-tokens", "16"]
    assert main(args) == 0
    before = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--set", "encode_token_s=1e-3", "--set", "kv_tokens=none"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    after = json.loads(out[-1])
    assert out[0].endswith("changed here: encode_token_s=0.001, kv_tokens=None") and "changed here" in after["profile"]
    slower, faster = (r["recommendations"][0]["colocated"]["goodput"] for r in (after, before))
    assert slower < faster  # a 30x slower encoder: less goodput
    for bad in ("steps=1", "source=x", "max_num_seqs=1.5", "step_s"):
        with pytest.raises(SystemExit):
            main([*args, "--set", bad])


def test_a_profile_with_an_unknown_field_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("source: x\nencode_tokens_s: 1\n")
    with pytest.raises(ValueError, match="encode_tokens_s"):
        load_profile(str(bad))
    assert load_profile(HAND).source.startswith("hand-written")


def _records(stage, n: int = 24) -> list[dict]:
    """Requests of 1-2 images (64 tokens each) and 20-28 text tokens, their stage times from `stage`."""
    out = []
    for i in range(n):
        images, text = 1 + i % 2, 20 + i % 9
        prompt = text + 64 * images
        stages = stage(images * 64, prompt)
        out.append({"send_s": i * 0.5, "ttft_ms": stages["ttft_ms"], "e2e_ms": stages["ttft_ms"] + 100,
                    "output_tokens": 17, "input_tokens": prompt, "images": images, "stage_ms": stages})
    return out


def test_the_fit_recovers_the_stage_times_it_was_given():
    from mmserve.capacity.fit import fit_profile

    def alone(image_tokens, prompt):  # 10 ms + 0.5 ms a token to encode, 0.1 ms a prompt token, 3 ms a step
        embeddings, prefill = 10 + 0.5 * image_tokens, 3 + 0.1 * prompt
        return {"router_ms": 5, "embeddings_ms": embeddings, "prefill_queue_ms": 1, "prefill_ms": prefill,
                "decode_ms": 16 * 3.0, "ttft_ms": 12 + embeddings + 1 + prefill}

    def loaded(image_tokens, prompt):  # 4 at a time: 3 ms + 3 x 0.5 ms a step
        return {**alone(image_tokens, prompt), "decode_ms": 16 * 4.5}

    runs = [{"label": "fit-unloaded", "requests": _records(alone)}, {"label": "fit-loaded", "requests": _records(loaded)}]
    profile, shape = fit_profile("disaggregated", runs)
    assert shape["image_tokens"] == 64 and abs(shape["text_tokens"] - 24) <= 1 and shape["output_tokens"] == 17
    assert profile.encode_batch_s == pytest.approx(0.010) and profile.encode_token_s == pytest.approx(0.0005)
    assert profile.prefill_token_s == pytest.approx(0.0001) and profile.router_s == pytest.approx(0.012)
    assert profile.decode_seq_s == pytest.approx(0.0005) and profile.step_s == pytest.approx(0.0025)
    colocated, _ = fit_profile("colocated", runs)  # the replica's own encoder: the same stage fits
    assert colocated.encode_token_s == pytest.approx(0.0005) and colocated.prefill_token_s == pytest.approx(0.0001)


def test_validate_on_a_kept_run_set_reports_every_held_out_rate(capsys):
    assert main(["--validate", "--runs", str(ROOT / "tests" / "data" / "plan_runs.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in ("max_rel_error", "max_rel_error_p99_ttft", "saturated_point_rel_error", "real_run_spread",
                "capacity_drift"):  # the kept set has the flood after the held-out rates too
        assert isinstance(summary[key], float) and summary[key] >= 0
    rows = [line.split() for line in out if line.startswith(("disaggregated", "colocated"))]
    assert len(rows) == 6 and {r[2] for r in rows} >= {"yes"}  # 3 rates x 2 modes, one of them saturated


def test_validate_runs_the_app_through_the_collector_it_is_given(tmp_path, capsys):
    """`mmserve plan --validate` passes deployments/cli/plan_runs.py's `collect`; without one (the
    planner alone) only a kept run set can be validated."""
    kept = json.loads((ROOT / "tests" / "data" / "plan_runs.json").read_text())
    asked = []

    def collect(num_prompts: int, seed: int) -> dict:
        asked.append((num_prompts, seed))
        return kept

    record = tmp_path / "runs.json"
    assert main(["--validate", "--quick", "--seed", "3", "--record", str(record)], collect=collect) == 0
    assert asked == [(60, 3)] and json.loads(record.read_text()) == kept
    with pytest.raises(SystemExit):
        main(["--validate"])
    assert "--runs FILE" in capsys.readouterr().err
