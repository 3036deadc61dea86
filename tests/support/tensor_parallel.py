"""A tensor-parallel LLM engine in the test process (rank 0) with its other ranks as spawned
processes running `llm_service.model.model_runner.rank_main`, joined over gloo on loopback."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket

import torch

from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine
from llm_service.model.language_model import LanguageModel
from llm_service.model.model_runner import rank_main
from llm_service.model.tensor_parallel import TPGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, size, init, model_dir, dtype, device, config, results):
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if device == "cuda" else device
    results.put((rank, rank_main(rank, size, init, model_dir, dtype, device, config)))


@contextlib.contextmanager
def tp_engine(model_dir: str, size: int, dtype: str = "float64", device: str = "cpu", **config):
    """An `LLMEngine` at `tensor_parallel_size` `size` (not started: the test steps it), the
    other ranks' process ids in `engine.rank_pids` (`device` "cuda": rank r on `cuda:r`); on
    exit their collective counts are in `engine.rank_counts` ({rank: counts}, ranks that ended
    cleanly)."""
    cfg = EngineConfig(tensor_parallel_size=size, **config)
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, size, init, model_dir, dtype, device, cfg, results), daemon=True)
             for r in range(1, size)]
    for p in procs:
        p.start()
    device = "cuda:0" if device == "cuda" else device
    group = TPGroup(0, size, init, torch.device(device), timeout_s=120)
    engine = None
    try:
        engine = LLMEngine(LanguageModel(model_dir, dtype=dtype, device=device, tp=group), cfg)
        engine.rank_pids = {r: p.pid for r, p in enumerate(procs, 1)}
        yield engine
    finally:
        if engine is not None:
            engine.shutdown()
        for p in procs:
            p.join(60)
        if engine is not None:
            engine.rank_counts = dict(results.get(timeout=5) for _ in procs if not results.empty())
        group.close()
        for p in procs:
            if p.is_alive():
                p.kill()
