"""The routing simulation against real runs (`mmserve plan --validate-routing`): a routing run set
(deployments/cli/routing_runs.py collects it; tests/data/routing_runs.json is one) replayed in
`mmserve.capacity.routing.simulate_cluster`, per policy, against what the app did; the fit, the
figures and the SLOs: docs/capacity.md#--validate-routing.

A run set: {"replicas": [E, L], "max_pending_requests": n, "rates": [...], "policies": {policy: {"runs": [
  {"label": "warm-up" | "fit-unloaded" | "fit-loaded" | "fit-saturated" | "held-out", "rate": r or null,
   "start_s": when it began on the app's clock, "encoder_hits": embedding hits across it (cache + dedup,
   all encoder replicas), "cached_tokens": prompt tokens the prefix caches served across it,
   "requests": [bench serve's records + "images", "image_seeds", "system"]}]}}}

Each policy's session is replayed whole, every run at its start and its requests at their send times,
so that the simulated caches carry over from run to run as the app's did. A request's prompt: its
system prompt's tokens (shared by every request with that prompt) or, without one, the chat template's
opening (`template_tokens` of the run set), its images' (keyed by seed), then its own text."""

from __future__ import annotations

import statistics

from mmserve.capacity.fit import _least_squares, fit_profile, load_or_collect
from mmserve.capacity.routing import BLOCK_SIZE, Content, simulate_cluster
from mmserve.capacity.simulate import percentile
from mmserve.inputs.media import PlaceholderRange
from mmserve.routing.affinity import prefix_hashes

FIGURES = ("encoder_hit_ratio", "prefix_hit_ratio", "ttft_p50_s", "ttft_p99_s", "goodput")
# the stages the simulation models apart, medians: router to LLM replica (encode queue, encode, transfer;
# requests with images) and LLM replica to first token (prefill queue, prefill); real ones from `stage_ms`
STAGES = ("embeddings_p50_s", "prefill_p50_s")
KEYS = (*FIGURES, *STAGES)
MODEL_SEEDS = 8  # replays of each policy's session, averaged


def slos(run_set: dict) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in seconds: 3 x the unloaded run's medians."""
    alone = _run(run_set, "default", "fit-unloaded")["requests"]
    tpot = [(r["e2e_ms"] - r["ttft_ms"]) / 1000 / (r["output_tokens"] - 1) for r in alone if r["output_tokens"] > 1]
    return 3 * percentile([r["ttft_ms"] / 1000 for r in alone], 50), 3 * percentile(tpot, 50)


def _run(run_set: dict, policy: str, label: str) -> dict:
    return next(r for r in run_set["policies"][policy]["runs"] if r["label"] == label)


def prompt_shape(run_set: dict, image_tokens: int) -> int:
    """Tokens a system prompt adds to a prompt (its turn replaces the template's default one), from the
    requests' token counts (least squares on images and system)."""
    requests = [r for entry in run_set["policies"].values() for run in entry["runs"] for r in run["requests"]
                if r.get("input_tokens")]
    rows = [[1, r["images"] * image_tokens, r.get("system") is not None] for r in requests]
    return max(0, round(_least_squares(rows, [r["input_tokens"] for r in requests])[2]))


TEMPLATE_BASE = -50_000  # the template opening's token ids (apart from the system prompts')


def _content(r: dict, image_tokens: int, system_tokens: int, fresh: list[int], template_tokens: int = 0) -> Content:
    segments, ranges, keys = [], [], []
    if r.get("system") is not None and system_tokens:  # its turn in place of the template's default one:
        base = -(r["system"] + 1) * 100_000  # the opening's tokens, and the system prompt's beyond them
        segments.append(range(base, base + template_tokens + system_tokens))
    elif template_tokens:  # the template's own opening (its default system turn), the same in every such prompt
        segments.append(range(TEMPLATE_BASE, TEMPLATE_BASE + template_tokens))
    offset = sum(len(s) for s in segments)
    for seed in r["image_seeds"]:
        ranges.append(PlaceholderRange(offset, image_tokens))
        keys.append(f"img-{seed}")
        segments.append((0,) * image_tokens)
        offset += image_tokens
    text = max(1, (r.get("input_tokens") or offset + 1) - offset)
    segments.append(range(fresh[0], fresh[0] + text))
    fresh[0] += text
    tokens = [t for s in segments for t in s]
    images = tuple((k, image_tokens) for k in keys)
    return Content(images, len(tokens), max(1, r["output_tokens"] or 1), prefix_hashes(tokens, ranges, keys, BLOCK_SIZE))


def _figures(rows: list[tuple[float, float | None, float | None, float]], slo: tuple[float, float],
             encoder_hit_ratio: float, prefix_hit_ratio: float, embeddings: list[float], prefill: list[float]) -> dict:
    """A run's figures (`FIGURES`, `STAGES`) from its requests' (send, ttft, tpot, end) rows in seconds and
    stage times; goodput: requests within both SLOs a second, first send to last end."""
    ttft = [t for _, t, _, _ in rows if t is not None]
    span = max(end for *_, end in rows) - min(send for send, *_ in rows)
    good = sum(1 for _, t, tpot, _ in rows if t is not None and t <= slo[0] and (tpot or 0.0) <= slo[1])
    return {"encoder_hit_ratio": encoder_hit_ratio, "prefix_hit_ratio": prefix_hit_ratio,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "goodput": good / max(span, 1e-9),
            "embeddings_p50_s": percentile(embeddings, 50) if embeddings else 0.0,
            "prefill_p50_s": percentile(prefill, 50) if prefill else 0.0}


def real_figures(run: dict, slo: tuple[float, float]) -> dict:
    reqs = run["requests"]
    items = sum(r["images"] for r in reqs)
    prompt = sum(r.get("input_tokens") or 0 for r in reqs)
    rows = [(r["send_s"], r["ttft_ms"] / 1000 if r.get("ttft_ms") is not None else None,
             (r["e2e_ms"] - r["ttft_ms"]) / 1000 / (r["output_tokens"] - 1) if r.get("ttft_ms") is not None
             and r["output_tokens"] > 1 else None, r["send_s"] + r["e2e_ms"] / 1000) for r in reqs]
    staged = [r for r in reqs if r.get("ttft_ms") is not None and r.get("stage_ms")]
    embeddings = [r["stage_ms"].get("embeddings_ms", 0.0) / 1000 for r in staged if r["images"]]
    prefill = [(r["stage_ms"].get("prefill_queue_ms", 0.0) + r["stage_ms"].get("prefill_ms", 0.0)) / 1000 for r in staged]
    return _figures(rows, slo, run["encoder_hits"] / items if items else 0.0,
                    run["cached_tokens"] / prompt if prompt else 0.0, embeddings, prefill)


def simulated_figures(run_set: dict, policy: str, profile, image_tokens: int, system_tokens: int,
                      slo: tuple[float, float], seed: int = 0) -> list[dict]:
    """Each held-out run's figures, from one replay of the policy's whole session."""
    encoders, llms = run_set["replicas"]
    runs = run_set["policies"][policy]["runs"]
    fresh, replay = [1 << 20], []  # (arrival, run, content) per request
    for k, run in enumerate(runs):
        for r in sorted(run["requests"], key=lambda r: r["send_s"]):
            content = _content(r, image_tokens, system_tokens, fresh, run_set.get("template_tokens", 0))
            replay.append((run["start_s"] + r["send_s"], k, content))
    replay.sort(key=lambda request: request[0])
    arrivals, owner, shapes = (list(column) for column in zip(*replay))
    trace: dict = {}
    simulate_cluster(profile, shapes, encoders, llms, policy, rate=1.0, seed=seed, warmup=0.0, arrivals=arrivals,
                     trace=trace)
    out = []
    for k, run in enumerate(runs):
        if run["label"] != "held-out":
            continue
        idx = [i for i, o in enumerate(owner) if o == k]
        reqs = [trace["requests"][i] for i in idx]
        items = sum(len(shapes[i].images) for i in idx)
        misses = sum(trace["misses"][i] for i in idx)
        rows = [(q.arrival, q.first_token - q.arrival if q.first_token is not None else None,
                 (q.finish - q.first_token) / (q.output_tokens - 1) if q.finish is not None and q.output_tokens > 1
                 else None, q.finish if q.finish is not None else q.arrival) for q in reqs]
        embeddings = [q.embedded - q.arrival - profile.router_s for q in reqs if q.image_sizes and q.embedded is not None]
        prefill = [q.first_token - q.embedded for q in reqs if q.first_token is not None and q.embedded is not None]
        prefix = sum(q.cached_tokens for q in reqs) / sum(q.prompt_tokens for q in reqs)
        out.append({"rate": run["rate"], **_figures(rows, slo, 1 - misses / items if items else 0.0, prefix,
                                                     embeddings, prefill)})
    return out


def validate_routing(run_set: dict) -> dict:
    """Fit, replay both policies, compare per policy and rate; the summary the command's JSON line prints."""
    encoders, llms = run_set["replicas"]
    profile, shape = fit_profile("disaggregated", run_set["policies"]["default"]["runs"], encoders, llms,
                                 run_set.get("max_pending_requests"))
    system_tokens = prompt_shape(run_set, shape["image_tokens"])
    slo = slos(run_set)
    rows, spreads = [], []
    for policy, entry in run_set["policies"].items():
        # the model's expectation: Serve's default picks at random, so one replay is one draw of it
        model_runs = [r for seed in range(MODEL_SEEDS)
                      for r in simulated_figures(run_set, policy, profile, shape["image_tokens"], system_tokens, slo,
                                                 seed=seed)]
        real_runs = [{"rate": run["rate"], **real_figures(run, slo)} for run in entry["runs"] if run["label"] == "held-out"]
        for rate in sorted({r["rate"] for r in real_runs}):
            real = [r for r in real_runs if r["rate"] == rate]
            model = [r for r in model_runs if r["rate"] == rate]
            mean_real = {k: statistics.fmean(r[k] for r in real) for k in KEYS}
            mean_model = {k: statistics.fmean(r[k] for r in model) for k in KEYS}
            rows.append({"policy": policy, "rate": rate, "real": mean_real, "model": mean_model,
                         "rel_error": {k: abs(mean_model[k] - mean_real[k]) / (mean_real[k] or 1) for k in KEYS}})
            for a, b in zip(real, real[1:]):
                spreads.append(max(abs(a[k] - b[k]) / max(a[k], b[k], 1e-12) for k in ("ttft_p50_s", "goodput")))
    return {
        "rows": rows, "profile": {k: v for k, v in vars(profile).items() if isinstance(v, float)},
        "system_tokens": system_tokens, "image_tokens": shape["image_tokens"], "slo_s": slo,
        "hit_ratio_rel_error_max": max(max(r["rel_error"]["encoder_hit_ratio"], r["rel_error"]["prefix_hit_ratio"])
                                       for r in rows),
        "ttft_p50_rel_error_max": max(r["rel_error"]["ttft_p50_s"] for r in rows),
        "goodput_rel_error_max": max(r["rel_error"]["goodput"] for r in rows),
        "real_run_spread": max(spreads) if spreads else None,
        "stage_p50_rel_error_max": {k: max(r["rel_error"][k] for r in rows) for k in STAGES},
    }


def print_routing_validation(report: dict) -> None:
    print("fitted profile: " + ", ".join(f"{k} {v:.3g}" for k, v in report["profile"].items()))
    print(f"prompt: {report['image_tokens']} tokens an image, {report['system_tokens']} a system prompt; "
          f"SLOs TTFT {report['slo_s'][0] * 1000:.0f} ms, TPOT {report['slo_s'][1] * 1000:.0f} ms")
    names = {"encoder_hit_ratio": "enc hit", "prefix_hit_ratio": "prefix hit", "ttft_p50_s": "TTFT p50 s",
             "ttft_p99_s": "TTFT p99 s", "goodput": "goodput/s"}
    for first, keys, width, digits in (("policy", FIGURES, 30, 3), ("stages", STAGES, 36, 4)):
        print(f"{first:<9} {'rate/s':>7} " + " ".join(f"{names.get(k, k) + ' real/model (err)':>{width}}" for k in keys))
        for r in report["rows"]:
            cells = [f"{r['real'][k]:.{digits}f}/{r['model'][k]:.{digits}f} ({r['rel_error'][k]:.2f})" for k in keys]
            print(f"{r['policy']:<9} {r['rate']:>7.3f} " + " ".join(f"{c:>{width}}" for c in cells))


def routing_validation_main(ns, collect_routing, error) -> int:
    """`--validate-routing [--runs FILE | --record FILE] [--num-prompts N] [--quick]`: validate a kept
    run set, or run the app here first (`collect_routing`, minutes) and validate that; one JSON line."""
    import json
    import time

    began = time.perf_counter()
    report = validate_routing(load_or_collect(ns, collect_routing, error, "--validate-routing", (16, 48)))
    print_routing_validation(report)
    keys = ("hit_ratio_rel_error_max", "ttft_p50_rel_error_max", "goodput_rel_error_max", "real_run_spread",
            "stage_p50_rel_error_max")
    summary = {k: round(report[k], 4) if isinstance(report[k], float)
               else {s: round(v, 4) for s, v in report[k].items()} if isinstance(report[k], dict) else report[k]
               for k in keys}
    print(json.dumps({**summary, "seconds": round(time.perf_counter() - began, 1)}))
    return 0
