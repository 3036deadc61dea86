"""The routing simulation (`mmserve plan --routing-scale`, mmserve/capacity/routing.py): its caches
against reference LRUs, its affinity decisions against the app's ring, the app's defaults, a small run."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

from mmserve.capacity.caches import ENCODER_CACHE_BYTES, EmbeddingLRU, PrefixCache
from mmserve.capacity.cli import main
from mmserve.capacity.inputs import Workload
from mmserve.capacity.routing import (BLOCK_SIZE, ENCODER_EPSILON, PREFIX_EPSILON, SENT_ITEMS, contents,
                                      typical_workload)
from mmserve.routing.affinity import AffinityChooser, BoundedLoadRing


def test_the_embedding_cache_equals_a_reference_lru_on_a_recorded_sequence():
    rng, capacity = random.Random(0), 1000
    cache, reference = EmbeddingLRU(capacity), OrderedDict()
    for _ in range(3000):
        k = rng.randrange(40)
        key, size = f"k{k}", 50 + 25 * (k % 20)  # one size per key
        hit = key in reference
        if hit:
            reference.move_to_end(key)
        assert cache.get(key) == hit
        if not hit and size <= capacity:
            cache.put(key, size)
            reference[key] = size
            while sum(reference.values()) > capacity:
                reference.popitem(last=False)
        assert sorted(cache.keys()) == sorted(reference)


def test_the_prefix_cache_keeps_freed_blocks_and_evicts_the_least_recently_freed():
    rng, blocks = random.Random(1), 12
    cache, reference = PrefixCache(blocks), OrderedDict()  # reference: freed hashes, least recently freed first
    for _ in range(500):
        prefix = rng.randrange(4)
        hashes = tuple(hash((prefix, i)) for i in range(rng.randint(1, 5)))
        cache.trim(len(hashes))  # room for the prompt about to run
        while reference and len(reference) + len(hashes) > blocks:
            reference.popitem(last=False)
        expected = next((i for i, h in enumerate(hashes) if h not in reference), len(hashes))
        held = cache.acquire(hashes)
        assert held == expected
        for h in hashes:
            reference.pop(h, None)
        cache.register(hashes, held)
        cache.release(hashes, len(hashes))
        for h in reversed(hashes):  # the engine frees a table last-first
            reference[h] = None
        assert all(cache.cached(h) for h in reference) and len(cache._free) == len(reference)


def test_the_simulated_affinity_choice_is_the_apps_ring_on_the_same_keys_and_loads():
    ids = [f"e{i}" for i in range(16)]
    rules, ring, rng = AffinityChooser(ENCODER_EPSILON, BLOCK_SIZE), BoundedLoadRing(ids), random.Random(2)
    for step in range(400):
        key, cost = f"img-{rng.randrange(50)}", rng.choice([400, 800])
        loads = {i: rules.loads[i] for i in ids}
        choice, _ = rules.choose_encoder([(key, cost)], ids)
        assert choice == ring.owner(key, loads, cost, ENCODER_EPSILON, rules.held.holders(key, ids))
        rules.encoder_routed([(key, cost)], choice)
        if step % 3 == 2:
            busy = max(ids, key=lambda i: rules.loads[i])
            rules.completed(busy, min(rules.loads[busy], 400))


def test_the_planner_uses_the_apps_defaults():
    from deployments.config import EngineArgs, RoutingArgs
    from encoder_service.pool import PoolConfig

    assert ENCODER_CACHE_BYTES == PoolConfig.cache_bytes and BLOCK_SIZE == EngineArgs().block_size
    assert (ENCODER_EPSILON, PREFIX_EPSILON) == (RoutingArgs().epsilon, RoutingArgs().prefix_epsilon)
    assert SENT_ITEMS == 1 << 16


def test_default_content_is_all_unique_and_popular_content_repeats():
    unique = contents(Workload(rate=1.0, images=(1, 4)), 200)
    keys = [k for c in unique for k, _ in c.images]
    assert len(keys) == len(set(keys)) and len({c.block_hashes[0] for c in unique}) == 200
    popular = contents(typical_workload(), 2000)
    keys = [k for c in popular for k, _ in c.images]
    assert len(set(keys)) < 0.7 * len(keys)
    turns = [c for c in popular if c.prompt_tokens > 512 + 4 * 400 + 64]  # only a next turn is this long
    assert turns


def test_a_small_routing_scale_run_ends_with_the_ratio_per_size(capsys, tmp_path):
    plot = tmp_path / "routing.svg"
    assert main(["--routing-scale", "--gpus", "4", "8", "--zipf", "1.0", "--requests-per-gpu", "16",
                 "--max-requests-per-gpu", "32", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert set(summary["affinity_over_default_goodput"]["typical"]) == {"4", "8"}
    assert summary["profile"].startswith("hand-written")
    assert summary["max_requests_per_gpu"] == 32 and all(n <= 32 for n, _ in summary["run_requests_per_gpu"].values())
    assert sum(" affinity " in line for line in out) == 2
    svg = plot.read_text()  # two bars (default, affinity) a size, each labelled with its goodput per GPU
    assert svg.startswith("<svg") and svg.count("<rect") == 4 and "4 GPUs" in svg and "8 GPUs" in svg


def test_validate_routing_on_a_kept_run_set_reports_both_policies_in_seconds(capsys):
    """`--validate-routing --runs tests/data/routing_runs.json`: both policies' held-out rates, real
    against the replayed simulation, and one JSON line with the errors and the real runs' spread."""
    import time
    from pathlib import Path

    runs = Path(__file__).resolve().parents[1] / "data" / "routing_runs.json"
    began = time.perf_counter()
    assert main(["--validate-routing", "--runs", str(runs)]) == 0
    assert time.perf_counter() - began < 30
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in ("hit_ratio_rel_error_max", "ttft_p50_rel_error_max", "goodput_rel_error_max", "real_run_spread"):
        assert isinstance(summary[key], float) and summary[key] >= 0
    # the stages the simulation models apart, against the real requests' stage_ms
    assert set(summary["stage_p50_rel_error_max"]) == {"embeddings_p50_s", "prefill_p50_s"}
    assert all(isinstance(v, float) and v >= 0 for v in summary["stage_p50_rel_error_max"].values())
    kept = json.loads(runs.read_text())
    rows = [line.split() for line in out if line.startswith(("default ", "affinity "))]
    assert len(rows) == 2 * 2 * len(kept["rates"]) and {r[0] for r in rows} == {"default", "affinity"}  # + stages


def test_validate_routing_runs_the_collector_it_is_given(tmp_path):
    from pathlib import Path

    kept = json.loads((Path(__file__).resolve().parents[1] / "data" / "routing_runs.json").read_text())
    asked = []

    def collect(num_prompts: int, seed: int) -> dict:
        asked.append((num_prompts, seed))
        return kept

    record = tmp_path / "runs.json"
    assert main(["--validate-routing", "--quick", "--record", str(record)], collect_routing=collect) == 0
    assert asked == [(16, 0)] and json.loads(record.read_text()) == kept


def test_the_template_opening_is_the_planners_tokens_before_the_first_image(tiny_checkpoint):
    """The run set's `template_tokens` (prompt tokens every request without a system prompt shares)
    equals where the app's own planner puts a lone image; the replay shares them (one block here)."""
    from deployments.cli.routing_runs import template_tokens
    from mmserve.capacity.routing_fit import _content
    from tests.support.cases import image, text, user
    from tests.support.pipeline import runtimes, to_planner_messages

    model_dir = tiny_checkpoint("qwen2_vl")
    planner, _, _ = runtimes(model_dir)
    plan = planner.plan(to_planner_messages(user(image(56, 56, 1), text("What is it?"))))
    assert template_tokens(model_dir) == plan.ranges[0].offset == 16
    request = {"system": None, "image_seeds": [], "input_tokens": 40, "output_tokens": 4}
    first, second = (_content(request, 70, 122, [1 << 20], template_tokens=16) for _ in range(2))
    assert first.block_hashes[0] == second.block_hashes[0]  # the opening block: a hit after the first
    assert _content(request, 70, 122, [1 << 20]).block_hashes[0] != first.block_hashes[0]


def test_a_system_prompts_turn_is_shared_whole_in_the_replay(tiny_checkpoint):
    """A system prompt's turn replaces the template's default one: the tokens before a lone image
    are the opening's plus what the system prompt adds (what `prompt_shape`'s least squares fits),
    and two requests with the same system prompt and different images share all their whole blocks."""
    from mmserve.capacity.routing_fit import _content
    from mmserve.loadgen.dataset import system_text
    from tests.support.cases import image, text, user
    from tests.support.pipeline import runtimes, to_planner_messages

    planner, _, _ = runtimes(tiny_checkpoint("qwen2_vl"))
    opening = planner.plan(to_planner_messages(user(image(56, 56, 1), text("What is it?")))).ranges[0].offset
    system = [{"role": "system", "content": [text(system_text(3, 40))]}]
    before = planner.plan(to_planner_messages(system + user(image(56, 56, 1), text("What is it?")))).ranges[0].offset
    added = before - opening  # what the fitted system share measures
    assert added > BLOCK_SIZE
    first, second = (_content({"system": 3, "image_seeds": [seed], "input_tokens": before + 90, "output_tokens": 4},
                              70, added, [1 << 20], template_tokens=opening) for seed in (1, 2))
    shared = next(k for k, (a, b) in enumerate(zip(first.block_hashes, second.block_hashes)) if a != b)
    assert shared == before // BLOCK_SIZE
