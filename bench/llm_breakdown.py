"""`python bench/llm.py --breakdown`: where an engine step's time goes, per step, for steady
decode at batch 1, 8 and 64 and for a step that mixes decodes with a prefill chunk, with steps
overlapped (`async_scheduling`) and not.

The engine is stepped from this thread (no engine thread), its `step_log` on: each `step()`
call's host time in scheduling, preparing the inputs, launching the forward (on the CPU this
runs it), launching the sampler, waiting for the sampled ids it reads and postprocessing them,
and on CUDA the device time of the step it reads (CUDA events). `host` is the engine's own work
around the forward (schedule + prepare + sample + postprocess). Ops per step come from
`torch.profiler` over a few more steps: CUDA kernels on a GPU, top-level aten ops on the CPU.
"""

from __future__ import annotations

import statistics

import torch

from llm_service.config import EngineConfig
from llm_service.engine import LLMEngine, LLMRequest
from llm_service.sampling import SamplingParams

COLUMNS = ("schedule", "prepare", "launch", "sample", "readback", "postprocess")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(10, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def _submit(engine: LLMEngine, tag: str, prompts, max_tokens: int) -> None:
    for i, ids in enumerate(prompts):
        engine.add_request(LLMRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                           lambda event: None)


def _decoding(engine: LLMEngine, batch: int) -> bool:
    running = engine.scheduler.running
    return len(running) == batch and all(s.num_computed >= s.num_prompt_tokens for s in running)


def measure(engine: LLMEngine, batch: int, context: int, steps: int, mixed: bool, profile_steps: int = 3) -> dict:
    """Mean `StepTimes` columns (microseconds) over `steps` steady steps of `batch` decoding
    sequences (`mixed`: each step also prefills a new `context`-token prompt, one token asked),
    and ops per step."""
    vocab = engine.model.vocab_size
    _submit(engine, f"d{batch}{mixed}", _prompts(batch, context, vocab, seed=batch), steps + profile_steps + 64)
    while not _decoding(engine, batch):
        engine.step()
    engine.step()  # the first decode step of the last one admitted
    arrivals = iter(_prompts(steps + profile_steps + 2, context, vocab, seed=1000 + batch)) if mixed else None
    engine.step_log = []
    for k in range(steps):
        if arrivals:
            _submit(engine, f"m{batch}-{k}", [next(arrivals)], 1)
        engine.step()
    log, engine.step_log = engine.step_log, None
    log = [t for t in log if t.num_seqs and (t.decode_only != mixed)]
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.model.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for k in range(profile_steps):
            if arrivals:
                _submit(engine, f"p{batch}-{k}", [next(arrivals)], 1)
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    ops = _count_ops(prof.events(), cuda) / profile_steps
    for request_id in list(engine._by_id):
        engine.abort(request_id)
    while engine.scheduler.running or engine.scheduler.waiting or engine._launched is not None:
        engine.step()
    row = {c: 1e6 * statistics.fmean(getattr(t, c) for t in log) for c in COLUMNS}
    row["host"] = row["schedule"] + row["prepare"] + row["sample"] + row["postprocess"]
    row["step"] = sum(row[c] for c in COLUMNS)
    devices = [t.device for t in log if t.device is not None]
    row["device"] = 1e6 * statistics.fmean(devices) if devices else None
    row["ops"] = ops
    row["steps"] = len(log)
    return row


def _count_ops(events, cuda: bool) -> int:
    if cuda:  # kernels the device ran (replayed graphs' included)
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def run(lm, context: int, steps: int, batches=(1, 8, 64), **config) -> dict:
    """Every breakdown row, overlap off and on (`config`: more `EngineConfig` settings); returns
    {"<case> <off|on>": row}."""
    rows = {}
    for overlap in (False, True):
        engine = LLMEngine(lm, EngineConfig(max_num_seqs=max(batches) + 1, max_num_batched_tokens=4096,
                                            async_scheduling=overlap, **config))
        for batch, mixed in [(b, False) for b in batches] + [(8, True)]:
            case = f"{'mixed' if mixed else 'decode'} b{batch} {'on' if overlap else 'off'}"
            rows[case] = measure(engine, batch, context, steps, mixed)
        engine.shutdown()
    return rows


def print_table(rows: dict) -> None:
    cols = (*COLUMNS, "host", "step", "device", "ops")
    print("per step, microseconds (ops: kernels on CUDA, top-level aten ops on CPU)")
    print(f"{'case':<16}" + "".join(f"{c:>12}" for c in cols))
    for case, row in rows.items():
        cells = [f"{row[c]:>12.1f}" if row[c] is not None else f"{'-':>12}" for c in cols]
        print(f"{case:<16}" + "".join(cells))


def summary(rows: dict) -> dict:
    """The JSON figures: per case and mode, host and step microseconds and ops per step."""
    out = {}
    for case, row in rows.items():
        key = case.replace(" ", "_")
        out[f"{key}_host_us"] = round(row["host"], 1)
        out[f"{key}_step_us"] = round(row["step"], 1)
        if row["device"] is not None:
            out[f"{key}_device_us"] = round(row["device"], 1)
        out[f"{key}_ops"] = round(row["ops"], 1)
    return out
