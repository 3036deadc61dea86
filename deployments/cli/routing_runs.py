"""`mmserve plan --validate-routing`'s runs: `bench serve --compare routing`'s app and workload A
(2 encoder + 2 LLM replicas, popular images, shared system prompts), in this process, under both
routing policies (`collect`, injected into `mmserve.capacity.cli` by the `mmserve` command line).

The runs (fit runs on the default app: `FIT_LOADED_CONCURRENCY`, `RATE_FACTORS`; then each rate `REPEATS`
times per policy, interleaved) and what each records: docs/capacity.md#--validate-routing;
`mmserve.capacity.routing_fit.validate_routing` replays them.
"""

from __future__ import annotations

import asyncio
import time

from deployments.cli.bench_app import start_app, stop_app
from mmserve.capacity.fit import FIT_LOADED_CONCURRENCY
from mmserve.loadgen.checkpoints import bench_checkpoint
from mmserve.loadgen.client import run_load
from mmserve.loadgen.dataset import DatasetConfig, ResolutionBucket, arrival_times, generate_requests

POLICIES = ("default", "affinity")
REPLICAS = (2, 2)  # (encoder, LLM): bench/serve_routing.py's
WORKLOAD = dict(image_pool=20, repeat_share=0.3, system_prompts=5, system_share=0.5)  # its workload A
RATE_FACTORS = (0.3, 0.6)  # x one request at a time: below saturation
REPEATS = 2
SATURATING_CONCURRENCY = 12


def _counters() -> tuple[int, int]:
    """(embedding hits summed over the encoder replicas, prefix-cached prompt tokens over the LLM replicas)."""
    from ray import serve

    from deployments.serve.encoder import encoder_stats

    encoders = encoder_stats(serve.get_deployment_handle("Encoder", app_name="bench"), REPLICAS[0])
    llms = encoder_stats(serve.get_deployment_handle("LLM", app_name="bench"), REPLICAS[1])  # any `stats` with a replica id
    return (sum(s["cache_hits"] + s["dedup_hits"] for s in encoders.values()),
            sum(s["num_cached_tokens"] for s in llms.values()))


def template_tokens(model_dir: str) -> int:
    """Prompt tokens before the first image of a request without a system prompt: the chat
    template's opening (its default system turn, the user turn's start), shared by every such
    request and so a prefix-cache hit after the first."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    ids = processor.tokenizer(processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"]
    return ids.index(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def collect(num_prompts: int, seed: int = 0, num_cpus: float = 2.0) -> dict:
    """Runs both policies' apps here (Ray + Serve) and records every run: a routing run set."""
    from deployments.config import AppArgs

    model = bench_checkpoint()
    shape = dict(buckets=(ResolutionBucket(224, 224, 1.0),), max_images=2, text_only_share=0.0, input_len=24,
                 output_len=16)
    fresh, popular = DatasetConfig(**shape), DatasetConfig(**shape, **WORKLOAD)
    fit_sets = {"fit-unloaded": (16, 1), "fit-loaded": (24, FIT_LOADED_CONCURRENCY),
                "fit-saturated": (36, SATURATING_CONCURRENCY)}
    held_out = [[generate_requests(popular, num_prompts, seed + 10 + k + 100 * r) for r in range(REPEATS)]
                for k in range(len(RATE_FACTORS))]
    run_set: dict = {"machine": f"{num_cpus:g} CPUs", "replicas": list(REPLICAS), "workload": WORKLOAD,
                     "max_pending_requests": AppArgs.model_fields["max_pending_requests"].default, "policies": {},
                     "template_tokens": template_tokens(model)}
    rates = None
    for policy in POLICIES:
        url, _ = start_app(model, False, num_cpus, "float32", replicas=REPLICAS, routing=policy)
        began, runs = time.perf_counter(), []

        def record(label: str, specs, rate=None, concurrency=None, offsets=None) -> list[dict]:
            hits, cached = _counters()
            start = time.perf_counter()
            out = asyncio.run(run_load(url, "bench", specs, offsets or [0.0] * len(specs), f"{policy} {label}",
                                       concurrency=concurrency))
            hits_after, cached_after = _counters()
            requests = [{**r.as_json(start), "images": len(s.images), "image_seeds": [i.seed for i in s.images],
                         "system": s.system} for r, s in zip(out, specs)]
            runs.append({"label": label, "rate": rate, "concurrency": concurrency, "start_s": start - began,
                         "encoder_hits": hits_after - hits, "cached_tokens": cached_after - cached,
                         "requests": requests})
            return requests

        try:
            record("warm-up", generate_requests(fresh, 8, seed + 3), concurrency=2)
            if policy == "default":
                for k, (label, (n, concurrency)) in enumerate(fit_sets.items()):
                    record(label, generate_requests(fresh, n, seed + 1 + k), concurrency=concurrency)
                alone = [r for r in runs if r["label"] == "fit-unloaded"][0]["requests"]
                mean_e2e_s = sum(r["e2e_ms"] for r in alone) / len(alone) / 1000
                rates = [round(k / mean_e2e_s, 3) for k in RATE_FACTORS]
            for r in range(REPEATS):
                for rate, sets in zip(rates, held_out):
                    record("held-out", sets[r], rate=rate, offsets=arrival_times(num_prompts, rate, seed + r))
        finally:
            stop_app()
        run_set["policies"][policy] = {"runs": runs}
    run_set["rates"] = rates
    return run_set
