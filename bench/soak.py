"""Soak: a served app under load, bad inputs and replica kills; nothing good may be lost or wrong.

    python bench/soak.py [--requests 300] [--concurrency 16] [--burst 256] [--seed 0]
    mmserve bench soak ...

On loopback, the tiny Qwen2-VL in float64 (greedy outputs are exact), 2 LLM + 2 encoder replicas
(encoder caches off, so every run encodes). Phases:
1. unloaded: sequential streams, TTFT p50 / p99;
2. reference: every good request once, no fault (the expected outputs);
3. soak: all requests (10% bad inputs of many kinds) at `--concurrency`; one encoder replica is
   killed while it holds encode calls, and one LLM replica once every stream in flight has sent
   >= 2 tokens and has >= 8 left (new requests wait for that moment). A good request is lost if
   it does not complete with 200, wrong if its tokens differ from the reference; a bad input is
   rejected cleanly if it gets a 4xx with a JSON error message;
4. burst: `--burst` requests at once: 429s, and p99 TTFT of the admitted vs unloaded.
RSS of every replica is sampled at the start and the end of the soak.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deployments.cli.bench_app import start_serve
from mmserve.loadgen.soak import SoakRequest, burst, burst_summary, good_request, pct, replica_rss_mb, send, soak, \
    soak_requests

APP = "soak"


# -- the run ---------------------------------------------------------------------------------
def start_app(ns: argparse.Namespace) -> str:
    from mmserve.tiny import ensure_tiny_model

    model = ns.model or str(ensure_tiny_model("qwen2_vl", Path(tempfile.gettempdir()) / "mmserve-soak-qwen2_vl"))
    small = {"num_cpus": 0.1}
    args = {"model": model, "dtype": "float64", "served_model_name": APP, "router": small,
            "encoder": {**small, "num_replicas": 2}, "llm": {**small, "num_replicas": 2},
            "encoder_pool": {"cache_bytes": 0}, **json.loads(ns.app_args)}
    port, _ = start_serve(4, apps={APP: args})
    return f"http://127.0.0.1:{port}/v1/chat/completions"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--bad-share", type=float, default=0.1)
    p.add_argument("--burst", type=int, default=256)
    p.add_argument("--unloaded", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen2-VL)")
    p.add_argument("--app-args", default="{}", help="JSON merged into the app arguments")
    p.add_argument("--burst-only", action="store_true", help="only the unloaded and burst phases (tuning admission)")
    ns = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.perf_counter()
    url = start_app(ns)
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name=APP)
    print(f"app up in {time.perf_counter() - t0:.0f}s", flush=True)

    rng = random.Random(ns.seed + 1)
    with httpx.Client() as client:
        unloaded = [send(client, url, SoakRequest(r.index, True, True, {**r.body, "stream": True}))
                    for r in (good_request(20_000 + i, rng, light=True) for i in range(ns.unloaded))]
    unloaded_ttft = [r.ttft_s * 1000 for r in unloaded if r.ttft_s is not None]
    print(f"unloaded: TTFT p50 {pct(unloaded_ttft, 50):.0f} ms, p99 {pct(unloaded_ttft, 99):.0f} ms", flush=True)

    if ns.burst_only:
        print(json.dumps(burst_summary(burst(url, ns.burst, ns.seed + 2), pct(unloaded_ttft, 99))))
        serve.shutdown()
        return 0
    requests = soak_requests(ns.requests, ns.bad_share, ns.seed)
    good = [r for r in requests if r.good]
    print(f"reference: {len(good)} good requests, no fault; then soak: {len(requests)} requests "
          f"({len(requests) - len(good)} bad), concurrency {ns.concurrency}, one encoder and one LLM replica killed",
          flush=True)
    rss_start: dict[str, float] = {}
    before: dict = {}

    def before_faults() -> None:
        rss_start.update(replica_rss_mb(APP))
        before.update(router.failover_stats.remote().result())

    outcome = soak(url, APP, requests, ns.concurrency, before_faults=before_faults)
    after = router.failover_stats.remote().result()
    lost, wrong, unclean, results = outcome.lost, outcome.wrong, outcome.unclean, outcome.results

    print(f"burst: {ns.burst} requests at once", flush=True)
    shot = burst(url, ns.burst, ns.seed + 2)
    rss_end = replica_rss_mb(APP)
    loaded = burst_summary(shot, pct(unloaded_ttft, 99))
    growth = {n: rss_end[n] - rss_start[n] for n in set(rss_start) & set(rss_end)}

    rows = [
        ("unloaded", f"{len(unloaded)} sequential", f"{pct(unloaded_ttft, 50):.0f}", f"{pct(unloaded_ttft, 99):.0f}"),
        ("reference", f"{len(good)} good in {outcome.reference_s:.0f}s", "", ""),
        ("soak", f"{len(requests)} in {outcome.soak_s:.0f}s: lost {len(lost)}, wrong {len(wrong)}, "
                 f"bad not rejected {len(unclean)}/{len(requests) - len(good)}", "", ""),
        ("burst", f"{ns.burst} at once: 200 {loaded['burst_admitted']}, 429 {loaded['shed_429']}, "
                  f"other {loaded['burst_other_statuses'] or '-'}",
         f"{loaded['loaded_p50_ttft_ms']:.0f}", f"{loaded['loaded_p99_ttft_ms']:.0f}"),
    ]
    print(f"\n{'phase':<10} {'requests':<64} {'TTFT p50 ms':>11} {'p99 ms':>8}")
    for row in rows:
        print(f"{row[0]:<10} {row[1]:<64} {row[2]:>11} {row[3]:>8}")
    print(f"\nfaults: {outcome.faults}; failover counters during the soak: "
          f"{ {k: after[k] - before[k] for k in after} }")
    print(f"\n{'replica':<40} {'RSS start MB':>12} {'end MB':>8}")
    for name in sorted(set(rss_start) | set(rss_end)):
        start, end = rss_start.get(name), rss_end.get(name)
        print(f"{name:<40} {start or float('nan'):>12.0f} {end or float('nan'):>8.0f}")
    for kind, status, message in unclean:
        print(f"not rejected cleanly: {kind}: {status} {message}")
    for r in lost[:5]:
        print(f"lost: request {r.index}: {results[r.index].status} {results[r.index].message[:120]}")
    summary = {
        "good_requests": len(good), "good_lost": len(lost), "wrong_answers": len(wrong),
        "bad_inputs": len(requests) - len(good), "bad_not_rejected": len(unclean),
        "burst": ns.burst, **loaded, "unloaded_p99_ttft_ms": round(pct(unloaded_ttft, 99), 1),
        "rss_growth_mb": round(max(growth.values(), default=0.0), 1),
        "resumed_streams": after["resumed_streams"] - before["resumed_streams"],
        "reencoded_items": after["reencoded_items"] - before["reencoded_items"],
        **outcome.faults, "seconds": round(time.perf_counter() - t0),
    }
    print(json.dumps(summary))
    serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
