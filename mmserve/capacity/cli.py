"""`mmserve plan`: the capacity planner's command line (`mmserve.capacity.simulate` simulates), its
goodput-per-GPU chart, and `--validate`: the model against real runs of the app on this machine
(`mmserve.capacity.fit`; the runs come from the `collect` the `mmserve` command line passes in,
deployments/cli/plan_runs.py, or from a kept run set: `--runs FILE`, seconds, no Ray)."""

from __future__ import annotations

from mmserve.capacity import simulate as capacity
from mmserve.capacity.fit import load_or_collect, print_validation, validate
from mmserve.capacity.goodput import RUN_TTFT_SLOS, TOLERANCE, Recommendation, recommend
from mmserve.capacity.inputs import PROFILES, SLO, TRANSPORTS, Workload, load_profile, with_changes, with_transfer_rates


def image_tokens_arg(values: list[str]) -> dict:
    """`--image-tokens 400` (every image) or `--image-tokens 256:0.7 1296:0.3` (a mix: tokens:share)."""
    if len(values) == 1 and ":" not in values[0]:
        return {"image_tokens": int(values[0])}
    mix = tuple((int(tokens), float(share or 1)) for tokens, _, share in (value.partition(":") for value in values))
    return {"image_tokens": round(sum(t * s for t, s in mix) / sum(s for _, s in mix)), "image_mix": mix}


def bars_svg(groups: list[tuple[list[str], list[tuple[float, str]]]], title: str, source: str, footer: str) -> str:
    """An SVG bar chart: per group its bars ((value, colour), each labelled with its value) and, below,
    its label lines."""
    extra = 12 * (max((len(lines) for lines, _ in groups), default=1) - 1)  # label lines past the first
    width, height, top, bottom, left = max(560, 70 * len(groups) + 80), 300 + extra, 40, 50 + extra, 60
    peak = max((v for _, bars in groups for v, _ in bars), default=0.0) or 1.0
    slot = (width - left - 20) / max(len(groups), 1)
    out = []
    for i, (lines, bars) in enumerate(groups):
        for j, (value, colour) in enumerate(bars):
            h = (height - top - bottom) * value / peak
            x = left + i * slot + 6 + j * (slot - 12) / len(bars)
            out.append(f'<rect x="{x:.1f}" y="{height - bottom - h:.1f}" width="{(slot - 12) / len(bars) - 3:.1f}" '
                       f'height="{h:.1f}" fill="{colour}"/><text x="{x:.1f}" y="{height - bottom - h - 4:.1f}" '
                       f'font-size="9">{value:.2f}</text>')
        out += [f'<text x="{left + i * slot + 6:.1f}" y="{height - bottom + 14 + 12 * k}" font-size="10">{line}</text>'
                for k, line in enumerate(lines)]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">'
            f'<text x="{left}" y="16" font-size="13">{title}</text>'
            f'<text x="{left}" y="30" font-size="9">{source}</text>'
            f'{"".join(out)}<text x="{left}" y="{height - 12}" font-size="10">{footer}</text></svg>')


def plot_svg(recommendations: list[Recommendation], source: str) -> str:
    """Goodput per GPU, disaggregated (best split) and colocated, at each cluster size."""
    groups = [([f"{r.gpus} GPUs ({r.disaggregated.num_encoders}E:{r.disaggregated.num_llms}L)"],
               [(r.disaggregated.per_gpu, "#4c72b0"), (r.colocated.per_gpu, "#dd8452")]) for r in recommendations]
    return bars_svg(groups, "Goodput per GPU (req/s within the SLOs): disaggregated (blue) vs colocated (orange)",
                    source, "mmserve plan (a simulation, not a measurement)")


def routing_plot_svg(rows: list, source: str) -> str:
    """Goodput per GPU under Serve's default routing and under affinity, per workload and cluster size
    (`mmserve plan --routing-scale --plot`)."""
    groups = [([row.workload, f"{row.gpus} GPUs {row.ratio:.2f}x"],
               [(row.default_goodput / row.gpus, "#4c72b0"), (row.affinity_goodput / row.gpus, "#55a868")])
              for row in rows]
    return bars_svg(groups, "Goodput per GPU (req/s within the SLOs): Serve's default (blue) vs affinity (green), "
                    "affinity / default below", source,
                    "mmserve plan --routing-scale (a simulation, not a measurement)")


def main(argv: list[str] | None = None, collect=None, collect_routing=None) -> int:
    """`collect(num_prompts, seed) -> run set`: runs the app for `--validate` (none: only `--runs`);
    `collect_routing`: the same for `--validate-routing`."""
    import argparse
    import json
    import time
    from pathlib import Path

    p = argparse.ArgumentParser(prog="mmserve plan", description=capacity.__doc__.split("\n\n")[0])
    bundled = ", ".join(sorted(f.stem for f in PROFILES.glob("*.yaml")))
    p.add_argument("--profile", default="a100-qwen3-vl-4b", help=f"a bundled profile ({bundled}) or a profile file "
                   "(YAML/JSON)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change one of the profile's figures (repeatable; the output says so): step_s=0.024")
    p.add_argument("--images", type=int, nargs=2, default=(1, 4), metavar=("LOW", "HIGH"), help="images per request")
    p.add_argument("--image-tokens", nargs="+", default=["400"], metavar="TOKENS[:SHARE]",
                   help="embedding tokens per image (640^2 on Qwen3-VL: 400), or a mix of resolutions as "
                        "tokens:share pairs (256:0.7 1296:0.3)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--length-range-ratio", type=float, default=0.0,
                   help="text and output lengths uniform in L x [1 - r, 1 + r] (vLLM's --random-range-ratio)")
    p.add_argument("--transport", choices=TRANSPORTS, default="object_store", help="how embeddings reach the LLMs")
    p.add_argument("--transfer-json", help="bench/transfer.py's output: both transports' measured rates")
    p.add_argument("--repeat-share", type=float, default=0.0, help="share of images the encoder cache serves")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--ttft-p99", type=float, default=None, help="SLO, seconds (default 20; --routing-scale: 2)")
    p.add_argument("--tpot-p99", type=float, default=0.1, help="SLO, seconds")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--cell", type=int, default=8, help="GPUs simulated together (a larger cluster is cells of it)")
    p.add_argument("--requests", type=int, default=1000, help="arrivals per simulated run, at least (a run also "
                   f"lasts {RUN_TTFT_SLOS} TTFT SLOs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--full", action="store_true", help="simulate every split of the cell, each goodput bisected from "
                   "1 req/s (minutes); by default each search starts at the analytic capacity and stops within "
                   f"{TOLERANCE * 100:g}%%, and the splits whose capacity cannot reach the best goodput are left out")
    p.add_argument("--plot", help="write the goodput-per-GPU chart here (SVG)")
    v = p.add_argument_group("validation")
    v.add_argument("--validate", action="store_true", help="instead: the model against real runs of the app on this "
                   "machine (minutes), a profile fitted on some of them, the others predicted")
    v.add_argument("--validate-routing", action="store_true", help="instead: the routing simulation (both "
                   "policies' hit ratios, TTFT, goodput) against real runs of bench serve --compare routing's app "
                   "and workload A (mmserve.capacity.routing_fit)")
    v.add_argument("--runs", type=Path, metavar="FILE", help="validate this kept run set instead of running the app")
    v.add_argument("--record", type=Path, metavar="FILE", help="keep the run set here (JSON)")
    v.add_argument("--num-prompts", type=int, default=None, help="requests per held-out rate (default 200; --quick 60)")
    v.add_argument("--quick", action="store_true")
    r = p.add_argument_group("routing at cluster scale")
    r.add_argument("--routing-scale", action="store_true", help="instead: Serve's default routing against affinity "
                   "over the whole cluster (--gpus), with the encoder and prefix caches, for the typical workload "
                   "and a popularity sweep (mmserve.capacity.routing)")
    r.add_argument("--zipf", type=float, nargs="+", default=[0.6, 0.8, 1.0, 1.2], help="the sweep's Zipf exponents")
    r.add_argument("--requests-per-gpu", type=int, default=60, help="arrivals simulated per GPU, at least (half "
                   "warm the caches); a run too short to judge its backlog is run again with twice as many")
    r.add_argument("--max-requests-per-gpu", type=int, default=None, help="...up to this many (default "
                   "480): bounds the run time")
    ns = p.parse_args(argv)
    if ns.validate_routing:
        from mmserve.capacity.routing_fit import routing_validation_main

        return routing_validation_main(ns, collect_routing, p.error)
    if ns.routing_scale:
        ns.ttft_p99 = 2.0 if ns.ttft_p99 is None else ns.ttft_p99
        return routing_main(ns)
    ns.ttft_p99 = 20.0 if ns.ttft_p99 is None else ns.ttft_p99
    if ns.validate:
        began = time.perf_counter()
        report = validate(load_or_collect(ns, collect, p.error, "--validate", (60, 200)))
        print_validation(report)
        for mode, profile in report["profiles"].items():
            print(f"fitted {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in profile.items() if isinstance(v, float)))
        summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in report.items()
                   if k not in ("rows", "profiles")}
        print(json.dumps({**summary, "seconds": round(time.perf_counter() - began, 1)}))
        return 0

    profile = load_profile(ns.profile)
    if ns.transfer_json:
        profile = with_transfer_rates(profile, ns.transfer_json)
    try:
        profile = with_changes(profile, ns.set)
        workload = Workload(rate=1.0, images=tuple(ns.images), text_tokens=ns.text_tokens,
                            output_tokens=ns.output_tokens, length_range_ratio=ns.length_range_ratio,
                            repeat_share=ns.repeat_share, burstiness=ns.burstiness, **image_tokens_arg(ns.image_tokens))
    except ValueError as e:
        p.error(str(e))
    slo = SLO(ns.ttft_p99, ns.tpot_p99)
    print(f"profile: {profile.source}")
    images = " + ".join(f"{t}:{s:g}" for t, s in workload.image_mix) or str(workload.image_tokens)
    ranged = f" (x [1 -/+ {ns.length_range_ratio:g}])" if ns.length_range_ratio else ""
    print(f"workload: {ns.images[0]}-{ns.images[1]} images x {images} tokens, {ns.text_tokens} text tokens, "
          f"{ns.output_tokens} out{ranged}, embeddings over {ns.transport}; SLOs p99 TTFT <= {ns.ttft_p99} s, "
          f"p99 TPOT <= {ns.tpot_p99 * 1000:g} ms")
    recommendations = [recommend(profile, workload, slo, gpus, ns.cell, ns.requests, ns.seed, ns.transport, ns.full)
                       for gpus in ns.gpus]
    print(f"{'GPUs':>6} {'encoders':>9} {'LLMs':>6} {'goodput/s':>10} {'per GPU':>8} {'colocated/s':>12} "
          f"{'per GPU':>8} {'margin':>7}")
    for rec in recommendations:
        d, c = rec.disaggregated, rec.colocated
        print(f"{rec.gpus:>6} {d.num_encoders:>9} {d.num_llms:>6} {d.goodput:>10.2f} {d.per_gpu:>8.3f} "
              f"{c.goodput:>12.2f} {c.per_gpu:>8.3f} {rec.margin:>7.2f}")
    if not ns.full:
        smallest = min(recommendations, key=lambda r: r.gpus)
        ruled_out = " ".join(f"{r.num_encoders}E:{r.num_llms}L" for r in smallest.ruled_out) or "none"
        print(f"searched from the analytic capacity to {TOLERANCE:.1%} (--full: every split, bisected from 1 req/s); "
              f"left out by their capacity at {smallest.gpus} GPUs: {ruled_out}")
    if ns.plot:
        Path(ns.plot).write_text(plot_svg(recommendations, profile.source))
    print(json.dumps({"profile": profile.source, "recommendations": [r.as_dict() for r in recommendations]}))
    return 0


def routing_main(ns) -> int:
    """`mmserve plan --routing-scale`: the table, then one JSON line."""
    import json
    from pathlib import Path

    from mmserve.capacity.routing import MAX_REQUESTS_PER_GPU, TYPICAL, routing_scale, typical_workload

    profile = with_changes(load_profile(ns.profile), ns.set)
    workloads = {"typical": typical_workload()}
    workloads.update({f"zipf{z:g}": typical_workload(zipf_exponent=z) for z in ns.zipf if z != 1.0})
    slo = SLO(ns.ttft_p99, ns.tpot_p99)
    print(f"profile: {profile.source}")
    print(f"typical workload: {TYPICAL}; SLOs p99 TTFT <= {ns.ttft_p99} s, p99 TPOT <= {ns.tpot_p99 * 1000:g} ms; "
          f"{ns.requests_per_gpu} requests per GPU; 1 encoder : 3 LLM replicas")
    print(f"{'workload':>9} {'GPUs':>5} {'policy':>9} {'goodput/GPU':>12} {'TTFT p99':>9} {'enc hits':>9} "
          f"{'prefix hits':>12} {'backlog/s':>10} {'req/GPU':>8} {'aff/def':>8}")

    def show(row) -> None:
        for policy, result, rate in row.policies():
            # backlog: its growth a second as a share of the rate, at goodput; req/GPU: the run's arrivals
            # (* : too short to judge at the cap, --max-requests-per-gpu)
            ttft, enc, pre, grow, run = ((f"{result.ttft_p99_s:.2f}", f"{result.encoder_hit_ratio:.2f}",
                                          f"{result.prefix_hit_ratio:.2f}", f"{result.backlog_growth:+.3f}",
                                          f"{result.requests // row.gpus}{'' if result.judged else '*'}")
                                         if result else ("-",) * 5)
            ratio = f"{row.ratio:.3f}" if policy == "affinity" else ""
            print(f"{row.workload:>9} {row.gpus:>5} {policy:>9} {rate / row.gpus:>12.3f} {ttft:>9} {enc:>9} "
                  f"{pre:>12} {grow:>10} {run:>8} {ratio:>8}", flush=True)

    rows = routing_scale(profile, workloads, ns.gpus, slo, ns.requests_per_gpu, ns.seed, progress=show,
                         max_requests_per_gpu=ns.max_requests_per_gpu)
    ratios = {name: {str(r.gpus): round(r.ratio, 3) for r in rows if r.workload == name} for name in workloads}
    if ns.plot:
        Path(ns.plot).write_text(routing_plot_svg(rows, profile.source))
    print(json.dumps({"profile": profile.source, "requests_per_gpu": ns.requests_per_gpu,
                      "max_requests_per_gpu": ns.max_requests_per_gpu or MAX_REQUESTS_PER_GPU,
                      "ttft_p99_s": ns.ttft_p99, "tpot_p99_s": ns.tpot_p99,
                      "goodput_per_gpu": {f"{r.workload}/{r.gpus}/{policy}": round(rate / r.gpus, 3) for r in rows
                                          for policy, _, rate in r.policies()},
                      # the run at each goodput: its arrivals per GPU, and whether it was long enough to judge
                      "run_requests_per_gpu": {f"{r.workload}/{r.gpus}/{policy}": (res.requests // r.gpus, res.judged)
                                               for r in rows for policy, res, _ in r.policies() if res},
                      "affinity_over_default_goodput": ratios}))
    return 0
