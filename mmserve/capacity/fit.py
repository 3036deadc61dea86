"""The capacity planner against real runs (`mmserve plan --validate`, docs/capacity.md#--validate): a
profile fitted on runs of the app on this machine, the held-out runs it predicts, the relative errors.

A run set (deployments/cli/plan_runs.py collects it): {"max_pending_requests": the app's admission bound
(its router's `max_pending_requests` x router replicas), "modes": {mode: {"encoders": E, "llms": L, "runs": [
  {"label": "fit-unloaded" | "fit-loaded" | "fit-saturated" | "fit-refused" | "held-out" | "repeat" |
             "fit-saturated-after",
   "rate": r or null, "concurrency": k or null, "requests": [bench serve's per-request records + "images"]}]}}}
Held-out runs are never fitted on.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace

from mmserve.capacity.inputs import Profile, Workload
from mmserve.capacity.simulate import percentile, simulate

FIT_LOADED_CONCURRENCY = 4


def _least_squares(rows: list[list[float]], targets: list[float]) -> list[float]:
    import numpy as np

    solution, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(targets, dtype=float), rcond=None)
    return [float(x) for x in solution]


def fit_profile(mode: str, runs: list[dict], encoders: int = 1, llms: int = 1,
                max_pending_requests: int | None = None) -> tuple[Profile, dict]:
    """A profile fitted on a mode's fit runs: one request at a time (stage times without queueing)
    and `FIT_LOADED_CONCURRENCY` at a time (how a step grows with its sequences); the floods of the
    app's `encoders` + `llms` replicas ("fit-saturated" and "-after": the mean), how much of the box
    they share; a flood past the admission bound ("fit-refused"), what a refusal costs the box; the
    admission bound (`max_pending_requests`, not fitted: its setting). Returns it with the workload's
    shape (image tokens, mean text and output tokens) read off the same requests."""
    by_label = {run["label"]: [r for r in run["requests"] if r.get("ttft_ms") is not None and r.get("stage_ms")]
                for run in runs}
    alone, loaded = by_label["fit-unloaded"], by_label["fit-loaded"]
    requests = alone + loaded
    text_tokens, image_tokens = _least_squares([[1, r["images"]] for r in requests], [r["input_tokens"] for r in requests])
    image_tokens = round(image_tokens)  # a whole number of placeholder tokens per image

    def ms(r: dict, stage: str) -> float:
        return r["stage_ms"].get(stage, 0.0) / 1000

    def tpot(rs: list[dict]) -> float:
        return percentile([ms(r, "decode_ms") / (r["output_tokens"] - 1) for r in rs if r["output_tokens"] > 1], 50)

    decode_seq_s = max(0.0, (tpot(loaded) - tpot(alone)) / (FIT_LOADED_CONCURRENCY - 1))
    step_s = max(0.0, tpot(alone) - decode_seq_s)
    encode_batch_s, encode_token_s = _least_squares([[1, r["images"] * image_tokens] for r in alone],
                                                    [ms(r, "embeddings_ms") for r in alone])
    prefill_token_s = _least_squares([[1, r["input_tokens"]] for r in alone], [ms(r, "prefill_ms") for r in alone])[1]
    # what the stages do not explain (the router, the proxy, the client): a fixed time per request
    overhead = [r["ttft_ms"] / 1000 - ms(r, "embeddings_ms") - ms(r, "prefill_queue_ms") - ms(r, "prefill_ms")
                for r in alone]
    profile = Profile(
        source=f"fitted on this machine's {mode} fit runs",
        router_s=max(0.0, percentile(overhead, 50)),
        encode_batch_s=max(0.0, encode_batch_s), encode_token_s=max(0.0, encode_token_s),  # the transfer inside
        step_s=step_s, decode_seq_s=decode_seq_s, prefill_token_s=max(0.0, prefill_token_s),
        max_batched_tokens=2048, max_num_seqs=64,  # the engine's defaults (EngineArgs)
        max_pending_requests=max_pending_requests)
    shape = {"image_tokens": image_tokens, "text_tokens": round(text_tokens),
             "output_tokens": round(statistics.fmean(r["output_tokens"] for r in requests))}
    floods = [by_label[label] for label in ("fit-saturated", "fit-saturated-after") if label in by_label]
    capacities = [c for c in (fit_shared_capacity(profile, shape, f, encoders, llms) for f in floods) if c]
    if capacities:
        profile = replace(profile, shared_capacity=round(statistics.fmean(capacities), 3))
    refused = next((run["requests"] for run in runs if run["label"] == "fit-refused"), None)
    if refused and max_pending_requests is not None:
        profile = replace(profile, refuse_s=fit_refuse_cost(profile, shape, refused, encoders, llms))
    return profile, shape


def fit_shared_capacity(profile: Profile, shape: dict, flood: list[dict], encoders: int, llms: int,
                        iterations: int = 20) -> float | None:
    """The smallest shared capacity, between 1 (one job at a time at full speed: a job alone runs
    at its measured speed) and the replica count (no sharing), with which the model keeps up with
    a real flood's sends, replayed: that flood was paced by the real app's completions, so a model
    slower than the app falls behind it and a faster one just keeps up. None when the replicas
    keep up only unshared, or fall behind even so (what slows the app is not the sharing)."""
    real = observed(flood)["throughput"]
    replicas = float(encoders + llms)

    def keeps_up(capacity: float | None) -> bool:
        model = predicted(replace(profile, shared_capacity=capacity), shape, flood, encoders, llms)
        return model["throughput"] >= 0.99 * real

    if replicas <= 1 or not keeps_up(None):
        return None
    if keeps_up(1.0):
        return 1.0
    low, high = 1.0, replicas
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (low, mid) if keeps_up(mid) else (mid, high)
    return round(high, 3) if high < replicas else None


def fit_refuse_cost(profile: Profile, shape: dict, run: list[dict], encoders: int, llms: int,
                    iterations: int = 20) -> float:
    """The work a refused request costs, such that the model, replaying a flood past the
    admission bound (its refused requests' sends included), serves no more per second than the
    app did; 0 when it does not even so (refusals cost nothing the model can see)."""
    real = observed(run)["throughput"]

    def too_fast(cost: float) -> bool:
        return predicted(replace(profile, refuse_s=cost), shape, run, encoders, llms)["throughput"] > 1.01 * real

    low, high = 0.0, max(profile.router_s, 1e-3)
    if not too_fast(low):
        return 0.0
    if too_fast(high):
        return round(high, 5)
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if too_fast(mid) else (low, mid)
    return round(high, 5)


def observed(requests: list[dict]) -> dict:
    """Throughput (completed per second, first send to last end), p50 and p99 TTFT of a real run."""
    done = [r for r in requests if r.get("ttft_ms") is not None]
    span = max(r["send_s"] + r["e2e_ms"] / 1000 for r in done) - min(r["send_s"] for r in requests)
    ttft = [r["ttft_ms"] / 1000 for r in done]
    return {"throughput": len(done) / span, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def predicted(profile: Profile, shape: dict, requests: list[dict], encoders: int, llms: int) -> dict:
    """The same figures from the simulation, replaying the real run's arrivals (times, images);
    like the real ones, of the requests served (the profile's admission refuses the rest)."""
    arrivals = sorted((r["send_s"], r["images"]) for r in requests)
    result = simulate(profile, Workload(rate=1.0, **shape), encoders, llms, arrivals=arrivals)
    return {"throughput": result.throughput, "ttft_p50_s": result.ttft_p50_s, "ttft_p99_s": result.ttft_p99_s}


def validate(run_set: dict) -> dict:
    """Fit each mode on its fit runs, predict its held-out rates, and compare (relative errors)."""
    rows, spreads, saturated_errors, fitted, drifts = [], [], [], {}, []
    for mode, entry in run_set["modes"].items():
        profile, shape = fit_profile(mode, entry["runs"], entry["encoders"], entry["llms"],
                                     run_set.get("max_pending_requests"))
        held_out = [run for run in entry["runs"] if run["label"] == "held-out"]
        fitted[mode] = asdict(profile)
        for run in held_out:
            real = observed(run["requests"])
            model = predicted(profile, shape, run["requests"], entry["encoders"], entry["llms"])
            errors = {k: abs(model[k] - real[k]) / real[k] for k in real}
            saturated = real["throughput"] < 0.9 * run["rate"]
            if saturated:
                saturated_errors.append(errors["throughput"])
            rows.append({"mode": mode, "rate": run["rate"], "saturated": saturated, "real": real, "model": model,
                         "rel_error": errors})
        floods = {r["label"]: observed(r["requests"])["throughput"] for r in entry["runs"]
                  if r["label"] in ("fit-saturated", "fit-saturated-after")}
        if len(floods) == 2:
            drifts.append(abs(floods["fit-saturated"] - floods["fit-saturated-after"]) / max(floods.values()))
        for run in (r for r in entry["runs"] if r["label"] == "repeat"):
            twin = next(h for h in held_out if h["rate"] == run["rate"])
            a, b = observed(twin["requests"]), observed(run["requests"])
            spreads.append(max(abs(a[k] - b[k]) / max(a[k], b[k]) for k in a))
    return {
        "rows": rows, "profiles": fitted,
        "max_rel_error": max(max(r["rel_error"]["throughput"], r["rel_error"]["ttft_p50_s"]) for r in rows),
        "max_rel_error_p99_ttft": max(r["rel_error"]["ttft_p99_s"] for r in rows),
        "saturated_point_rel_error": max(saturated_errors) if saturated_errors else None,
        "real_run_spread": max(spreads) if spreads else None,
        # the flood's throughput before and after the held-out runs: how far the box itself moved
        "capacity_drift": max(drifts) if drifts else None,
    }


def print_validation(report: dict) -> None:
    print(f"{'mode':<14} {'rate/s':>7} {'sat':>4} {'thr real':>9} {'model':>7} {'err':>6} {'p50 TTFT ms':>12} "
          f"{'model':>7} {'err':>6} {'p99 TTFT ms':>12} {'model':>7} {'err':>6}")
    for r in report["rows"]:
        real, model, err = r["real"], r["model"], r["rel_error"]
        print(f"{r['mode']:<14} {r['rate']:>7.2f} {'yes' if r['saturated'] else 'no':>4} "
              f"{real['throughput']:>9.2f} {model['throughput']:>7.2f} {err['throughput']:>6.2f} "
              f"{real['ttft_p50_s'] * 1000:>12.1f} {model['ttft_p50_s'] * 1000:>7.1f} {err['ttft_p50_s']:>6.2f} "
              f"{real['ttft_p99_s'] * 1000:>12.1f} {model['ttft_p99_s'] * 1000:>7.1f} {err['ttft_p99_s']:>6.2f}")


def load_or_collect(ns, collect, error, flag: str, prompts: tuple[int, int]) -> dict:
    """The run set `--validate` / `--validate-routing` (`flag`) checks: read from `--runs FILE`, or
    collected here by `collect(num_prompts, seed)` (`--num-prompts`, else `prompts` (quick, full)
    by `--quick`) and kept in `--record FILE` when given."""
    import json

    if ns.runs:
        return json.loads(ns.runs.read_text())
    if collect is None:
        error(f"{flag} runs the app: run it as `mmserve plan {flag}`, or give --runs FILE")
    run_set = collect(ns.num_prompts or (prompts[0] if ns.quick else prompts[1]), ns.seed)
    if ns.record:
        ns.record.write_text(json.dumps(run_set))
    return run_set
