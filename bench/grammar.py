"""Grammar engines for structured outputs (`response_format: json_schema`): xgrammar vs llguidance.

    python bench/grammar.py [--compiles 3] [--steps 512] [--batches 1,64] [--threads N] [--quick]

Both on CPU, side by side in one run, on a tokenizer of Qwen2's size built here
(`mmserve/loadgen/vocab.py`: 151,643 BPE tokens + 14 special tokens, the model's logits 151,936
wide; cached under the temporary directory) and one extraction schema (`mmserve/loadgen/grammar.py`:
an invoice, 30 top-level properties), compiled compact (no free whitespace, separators "," ":").
Per library: building its tokenizer info; a cold compile (median of `--compiles`; xgrammar's cache
off, llguidance has none: its compile is the first LLMatcher), the same schema without `maxLength`,
a matcher per sequence; compile + the first mask; a decode step (fill the batch's bitmask rows, then
each matcher accepts the next token of its own valid document, every token asserted accepted) at
each batch size, and at batch 1 without `maxLength`; the bitmask applied to float32 logits
[B, 151,936] by the library's apply function (and by plain torch); one document walked by both in
lock-step (masks compared, padding ids never allowed, special tokens counted, rollback and reset);
the bounds probes, the invalid schemas' errors; the main thread's progress while a compile runs in
another (the GIL); the installed size. xgrammar's TokenizerInfo gets the added special tokens
blanked (as shipped, `<|image_pad|>` is allowed inside strings: counted once). `--quick`: a 4k
vocabulary, 48 steps (the test suite's run, seconds). Wall times move with the machine's load (it is
printed); the CPU-time rows less.

Last line: one JSON object (`*_compile_ms`, `*_mask_b{B}_us` per step, ratios `*_llguidance_vs_xgrammar`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time


def _median_s(fn, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def _gil_share(g, compile_once) -> float:
    """g.main_thread_share over enough compiles to last 0.3 s."""
    repeats = max(1, math.ceil(0.3 / max(_median_s(compile_once, 1), 1e-6)))
    return g.main_thread_share(lambda: [compile_once() for _ in range(repeats)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiles", type=int, default=3, help="cold compiles per library (median; at least one per "
                        "batch size and one more: each walk starts from its own)")
    parser.add_argument("--steps", type=int, default=512, help="decode steps per batch size")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="both libraries' thread pools (default: this process's CPUs)")
    parser.add_argument("--bpe-tokens", type=int, default=None, help="default 151,643 (Qwen2's)")
    parser.add_argument("--model-vocab", type=int, default=None, help="logits width, default 151,936 (Qwen2's)")
    parser.add_argument("--no-torch-compile", action="store_true",
                        help="skip llguidance.torch's apply (a torch.compile kernel: ~15 s to build on CPU)")
    parser.add_argument("--quick", action="store_true", help="4k vocabulary, 2 compiles, 48 steps, no torch.compile")
    ns = parser.parse_args()
    if ns.quick:
        ns.compiles, ns.steps, ns.no_torch_compile = 1, 48, True
    batches = [int(b) for b in ns.batches.split(",")]

    import torch

    from mmserve.loadgen import grammar as g
    from mmserve.loadgen.vocab import QWEN2_BPE_TOKENS, QWEN2_MODEL_VOCAB, qwen_size_tokenizer

    bpe = ns.bpe_tokens or (4000 if ns.quick else QWEN2_BPE_TOKENS)
    model_vocab = ns.model_vocab or (QWEN2_MODEL_VOCAB if bpe == QWEN2_BPE_TOKENS else -(-(bpe + 64) // 128) * 128)
    start = time.perf_counter()
    tokenizer = qwen_size_tokenizer(bpe)
    tokenizer_s = time.perf_counter() - start
    docs = g.token_docs(tokenizer, max(batches))
    torch.set_num_threads(ns.threads)

    result: dict = {"loadavg_1m_start": round(os.getloadavg()[0], 2), "tokenizer_ids": len(tokenizer),
                    "model_vocab": model_vocab, "bpe_tokens": bpe,
                    "threads": ns.threads, "doc_tokens_mean": statistics.fmean(len(d) for d in docs),
                    "steps": ns.steps}
    engines, compiled, notes = [], [], {}
    for name, cls in g.ENGINES.items():
        start = time.perf_counter()
        engine = cls(tokenizer, model_vocab, ns.threads)
        info_s = time.perf_counter() - start
        engines.append(engine)
        r = {"version": engine.version, "vocab_ids": engine.vocab_ids, "tokenizer_info_s": info_s}

        # cold compiles (xgrammar's first through a cache-enabled compiler, empty: cold too; then its hits),
        # each followed by a first mask from a new matcher
        cached = engine.compiler(cache=True) if name == "xgrammar" else None
        grammars, walls, cpus, fills = [], [], [], []
        for i in range(max(ns.compiles, len(batches) + 1)):
            wall, cpu = time.perf_counter(), time.process_time()
            grammars.append(engine.compile(g.SCHEMA, cached if i == 0 else None))
            cpus.append(time.process_time() - cpu)
            walls.append(time.perf_counter() - wall)
            start = time.perf_counter()
            engine.fill([engine.matcher(grammars[-1])], engine.allocate(1))
            fills.append(time.perf_counter() - start)
        first = grammars[0]
        compiled.append(first)
        r.update(compile_ms=statistics.median(walls) * 1e3, compile_cpu_ms=statistics.median(cpus) * 1e3,
                 first_mask_ms=statistics.median(w + f for w, f in zip(walls, fills)) * 1e3,
                 matcher_us=_median_s(lambda: engine.matcher(first), 20) * 1e6)
        unbounded = g.without(g.SCHEMA, "maxLength")
        r["compile_no_maxlength_ms"] = _median_s(lambda: engine.compile(unbounded), ns.compiles) * 1e3
        r["mask_b1_no_maxlength_us"] = g.walk(engine, engine.compile(unbounded), docs[:1], ns.steps)["step_us"]
        if name == "xgrammar":
            r["cache_hit_us"] = _median_s(lambda: engine.compile(g.SCHEMA, cached), 20) * 1e6
        one_thread = engine.compiler(threads=1) if name == "xgrammar" else None
        r["gil_free_share"] = _gil_share(g, lambda: engine.compile(g.SMALL_SCHEMA, one_thread))
        for i, b in enumerate(batches, 1):  # a fresh compile: a new schema's first requests, lazy states included
            w = g.walk(engine, grammars[i], docs[:b], ns.steps)
            r.update({f"mask_b{b}_us": w["step_us"], f"fill_b{b}_us": w["fill_us"], f"accept_b{b}_us": w["accept_us"],
                      f"mask_b{b}_p50_us": w["step_p50_us"], f"mask_b{b}_max_us": w["step_max_us"],
                      f"mask_b{b}_cpu_us": w["step_cpu_us"]})
        for b in batches:
            logits, bitmask = torch.randn(b, model_vocab), engine.allocate(b)
            bitmask[:, 1::2] = 0x0F0F0F0F
            r[f"apply_b{b}_us"] = _median_s(lambda: engine.apply(logits, bitmask), 20) * 1e6
            if name == "xgrammar":  # the reference for the others' results, and plain torch's time
                want = torch.randn(b, model_vocab)
                got = want.clone()
                engine.apply(want, bitmask)
                g.apply_bitmask_torch(got, bitmask)
                assert torch.equal(want, got), "torch apply differs from xgrammar's"
                result[f"torch_apply_b{b}_us"] = _median_s(lambda: g.apply_bitmask_torch(logits, bitmask), 20) * 1e6
        if name == "llguidance" and not ns.no_torch_compile:
            logits, bitmask = torch.randn(batches[-1], model_vocab), engine.allocate(batches[-1])
            start = time.perf_counter()
            engine.apply_compiled(logits, bitmask)
            r["torch_compile_first_s"] = time.perf_counter() - start
            for b in batches:
                logits, bitmask = torch.randn(b, model_vocab), engine.allocate(b)
                engine.apply_compiled(logits, bitmask)
                r[f"apply_compiled_b{b}_us"] = _median_s(lambda: engine.apply_compiled(logits, bitmask), 20) * 1e6
        probes = g.probe(engine, first, tokenizer)
        r["probes_right"] = sum(valid == ok for _, valid, ok in probes)
        refused = g.refusals(engine)
        r["invalid_refused"] = sum(err is not None for _, err in refused)
        notes[name] = {"probes_wrong": [what for what, valid, ok in probes if valid != ok], "refusals": refused}
        footprint = g.install_footprint(name)
        r["install_mb"], notes[name]["requires"] = footprint["mb"], footprint["requires"]
        for key, value in r.items():
            result[f"{name}_{key}"] = round(value, 3) if isinstance(value, float) else value

    checked = g.check_walk(engines, compiled, tokenizer, docs[0])
    result.update(masks_identical_steps=checked["identical_steps"], checked_steps=checked["steps"])
    for e in engines:
        result[f"{e.name}_mean_allowed_tokens"] = round(checked["mean_allowed"][e.name], 1)
        result[f"{e.name}_special_steps"] = checked["special_steps"][e.name]
        result[f"{e.name}_rollback_ok"] = checked["rollback_ok"][e.name]
    # xgrammar's TokenizerInfo.from_huggingface as is: added special tokens are their literal text
    shipped = g.XGrammar(tokenizer, model_vocab, ns.threads, blank_specials=False)
    shipped.name = "as shipped"
    small_doc = tokenizer.encode(g.SMALL_DOC, add_special_tokens=False) + [tokenizer.eos_token_id]
    as_is = g.check_walk([shipped], [shipped.compile(g.SMALL_SCHEMA)], tokenizer, small_doc)
    result.update(xgrammar_unblanked_special_steps=as_is["special_steps"][shipped.name], small_doc_steps=len(small_doc),
                  loadavg_1m_end=round(os.getloadavg()[0], 2), probes=len(g.PROBES),
                  invalid_schemas=len(g.INVALID_SCHEMAS))

    x, ll = "xgrammar", "llguidance"
    table = [("version", "version", ""), ("vocab ids it sees", "vocab_ids", ""),
             ("tokenizer info", "tokenizer_info_s", "s"), ("cold compile", "compile_ms", "ms"),
             ("  its CPU time (all threads)", "compile_cpu_ms", "ms"),
             ("  the schema without maxLength", "compile_no_maxlength_ms", "ms"),
             ("compile + first mask", "first_mask_ms", "ms"), ("matcher per sequence", "matcher_us", "us"),
             ("compile cache hit", "cache_hit_us", "us")]
    for b in batches:
        table += [(f"mask step b={b}", f"mask_b{b}_us", "us"), (f"  fill b={b}", f"fill_b{b}_us", "us"),
                  (f"  accept b={b}", f"accept_b{b}_us", "us"), (f"  p50 b={b}", f"mask_b{b}_p50_us", "us"),
                  (f"  max b={b}", f"mask_b{b}_max_us", "us"), (f"  CPU time b={b}", f"mask_b{b}_cpu_us", "us"),
                  (f"  per row b={b}", None, "us")]
    table += [("mask step b=1, no maxLength", "mask_b1_no_maxlength_us", "us")]
    table += [(f"apply b={b} (own fn)", f"apply_b{b}_us", "us") for b in batches]
    if not ns.no_torch_compile:
        table += [(f"apply b={b} (llg torch.compile)", f"apply_compiled_b{b}_us", "us") for b in batches]
        table += [("  its first call", "torch_compile_first_s", "s")]
    table += [("mean allowed tokens/step", "mean_allowed_tokens", ""),
              ("steps allowing a special token", "special_steps", ""), ("rollback+reset right", "rollback_ok", ""),
              (f"bounds probes right /{len(g.PROBES)}", "probes_right", ""),
              (f"invalid schemas refused /{len(g.INVALID_SCHEMAS)}", "invalid_refused", ""),
              ("main thread during compile", "gil_free_share", "x"), ("installed size", "install_mb", "MB")]

    def cell(name: str, key: str | None, label: str) -> str:
        if key is None:  # per row: the step over the batch
            b = int(label.rsplit("=", 1)[1])
            v = result.get(f"{name}_mask_b{b}_us")
            return f"{v / b:.1f}" if v is not None else "-"
        v = result.get(f"{name}_{key}")
        return "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)

    print(f"tokenizer: {len(tokenizer):,} ids ({bpe:,} BPE + {len(tokenizer) - bpe} special), logits {model_vocab:,} "
          f"wide ({model_vocab - len(tokenizer)} padding ids); built/loaded in {tokenizer_s:.1f} s; "
          f"documents {result['doc_tokens_mean']:.0f} tokens on average; {ns.threads} threads; load average "
          f"{result['loadavg_1m_start']} -> {result['loadavg_1m_end']} (wall times grow with it, CPU times less)")
    print(f"{'':34}{'unit':>6}{x:>14}{ll:>14}{'llg / xgr':>11}")
    for label, key, unit in table:
        a, c = cell(x, key, label), cell(ll, key, label)
        va, vc = result.get(f"{x}_{key}"), result.get(f"{ll}_{key}")
        timed = unit not in ("", "x") and isinstance(va, float) and isinstance(vc, float) and va > 0
        ratio = f"{vc / va:.2f}" if timed else ""
        print(f"{label:<34}{unit:>6}{a:>14}{c:>14}{ratio:>11}")
    for b in batches:
        print(f"plain torch apply b={b}: {result[f'torch_apply_b{b}_us']:,.1f} us (the same result as xgrammar's)")
    print(f"masks identical at {checked['identical_steps']}/{checked['steps']} steps of one document; padding ids "
          "never allowed; EOS alone after the document")
    print(f"xgrammar's TokenizerInfo.from_huggingface as is (added special tokens not blanked): a special token "
          f"allowed at {result['xgrammar_unblanked_special_steps']}/{len(small_doc)} steps of {g.SMALL_DOC} "
          "(inside the string)")
    for name in (x, ll):
        n = notes[name]
        print(f"{name}: requires {', '.join(n['requires']) or 'nothing'}; probes wrong: {n['probes_wrong'] or 'none'}")
        for what, err in n["refusals"]:
            print(f"  {what:<22} {(err or 'COMPILED (not refused)')[:110]}")

    for key in ("compile_ms", "first_mask_ms", *(f"mask_b{b}_us" for b in batches)):
        ratio = result[f"{ll}_{key}"] / result[f"{x}_{key}"]
        result[f"{key.rsplit('_', 1)[0]}_llguidance_vs_xgrammar"] = round(ratio, 3)
    print("llguidance / xgrammar: " + ", ".join(f"{k.removesuffix('_llguidance_vs_xgrammar')} {v:.2f}x"
                                                 for k, v in result.items() if k.endswith("_llguidance_vs_xgrammar")))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
