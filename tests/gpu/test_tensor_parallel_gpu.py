"""Tensor parallelism on CUDA (NCCL for the collectives, gloo for the step messages): greedy
tokens at TP 2 equal TP 1 on the same devices, bf16 and float32. Needs two GPUs: skipped, with
its reason, on fewer (a lent single GPU included)."""

import pytest
import torch

from tests.support.cases import CASE_TOKENS, family_cases
from tests.support.engine_support import Collector, plan_request, run_until_done
from tests.support.tensor_parallel import tp_engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason=f"needs >= 2 CUDA GPUs, found {torch.cuda.device_count()}")]


def _tokens(engine, model_dir: str, family: str) -> dict[str, list[int]]:
    collector = Collector()
    for name, messages in family_cases(family).items():
        collector.add(engine, plan_request(model_dir, messages, name, CASE_TOKENS[family]))
    run_until_done(engine, collector)
    return {name: collector.tokens(name) for name in collector.events}


@pytest.mark.parametrize("family", ["qwen2_vl", "minicpmv4_6", "qwen3_vl_moe"])
def test_tp2_on_two_gpus_equals_tp1(tiny_checkpoint, family):
    from llm_service.engine.llm_engine import LLMEngine
    from llm_service.model.language_model import LanguageModel
    from llm_service.config import EngineConfig

    model_dir = tiny_checkpoint(family)
    single = LLMEngine(LanguageModel(model_dir, dtype="float32", device="cuda:0"),
                       EngineConfig(cuda_graphs=False, async_scheduling=False))
    expected = _tokens(single, model_dir, family)
    single.shutdown()
    with tp_engine(model_dir, 2, dtype="float32", device="cuda") as engine:
        assert _tokens(engine, model_dir, family) == expected
        assert engine.runner.tp.counts["all_reduce"] > 0
