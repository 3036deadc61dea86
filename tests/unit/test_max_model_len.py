"""`engine.max_model_len`: the router and the LLM engine resolve the same context length (the
setting, else the checkpoint's `max_position_embeddings`); a setting above the checkpoint's or
beyond the KV pool stops startup with a reason; prompt + max_tokens over it are refused."""

from __future__ import annotations

import asyncio
import json

import pytest

from deployments.api import openai_api
from deployments.cli.local_serve import RefusedToStart, check_on_node
from deployments.config import AppArgs
from deployments.cli.main import main
from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine
from mmserve.errors import InvalidRequest
from tests.support.cases import text, user
from tests.support.core_fakes import FakeLLM, make_core, reader
from tests.support.engine_support import Collector, language_model, plan_request, run_until_done

# the tiny Qwen2-VL in float64: 2 layers x K,V x 2 heads x 16 dims x 8 bytes = 1 KiB per token
ONE_MIB_OF_KV = dict(kv_cache_bytes=2**20, block_size=16)  # 64 blocks, 1,024 tokens


def _chat(max_tokens: int | None, words: int = 5):
    body = {"messages": [{"role": "user", "content": "count " * words}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return openai_api.chat_request(openai_api.parse_body(json.dumps(body).encode()))


def test_a_setting_above_the_checkpoints_context_stops_router_and_engine(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    with pytest.raises(ValueError, match="engine.max_model_len 5000 exceeds the checkpoint's max_position_embeddings 4096"):
        make_core(model_dir, engine={"max_model_len": 5000})
    with pytest.raises(ValueError, match="engine.max_model_len 5000 exceeds"):
        LLMEngine(language_model(model_dir), EngineConfig(max_model_len=5000, **ONE_MIB_OF_KV))
    with pytest.raises(RefusedToStart, match="max_position_embeddings 4096"):
        check_on_node(AppArgs(model=model_dir, engine={"max_model_len": 5000}))


def test_a_pool_shorter_than_one_sequence_stops_the_engine_naming_both(tiny_models):
    model = language_model(tiny_models["qwen2_vl"])
    with pytest.raises(ValueError) as e:
        LLMEngine(model, EngineConfig(**ONE_MIB_OF_KV))  # the checkpoint's 4,096 tokens
    assert "holds 1024 tokens (64 blocks of 16)" in str(e.value) and "max_model_len 4096" in str(e.value)
    assert "set engine.max_model_len to at most 1024" in str(e.value)
    with pytest.raises(ValueError, match="max_model_len 1025"):
        LLMEngine(model, EngineConfig(max_model_len=1025, **ONE_MIB_OF_KV))
    engine = LLMEngine(model, EngineConfig(max_model_len=1024, **ONE_MIB_OF_KV))
    assert engine.runner.max_model_len == 1024 and engine.runner.batch.block_tables.shape[1] == 1024 // 16


def test_the_engine_refuses_prompt_and_max_tokens_over_its_max_model_len(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = LLMEngine(language_model(model_dir), EngineConfig(max_model_len=64, **ONE_MIB_OF_KV))
    messages = user(text("count " * 10))
    prompt_len = len(plan_request(model_dir, messages, "probe", 1).prompt_token_ids)
    collector = Collector()
    collector.add(engine, plan_request(model_dir, messages, "over", 64 - prompt_len + 1))
    collector.add(engine, plan_request(model_dir, messages, "fits", 64 - prompt_len, ignore_eos=True))
    run_until_done(engine, collector)
    error = collector.events["over"][-1].error
    assert isinstance(error, InvalidRequest) and f"max_tokens {65 - prompt_len} exceed max_model_len 64" in str(error)
    assert collector.finish_reason("fits") == "length" and len(collector.tokens("fits")) == 64 - prompt_len


def test_a_lower_setting_makes_the_router_refuse_a_prompt_over_it(tiny_models):
    llm = FakeLLM()
    core = make_core(tiny_models["qwen2_vl"], llm, engine={"max_model_len": 64})
    assert core.max_model_len == 64 and core.model_cards()[0]["max_model_len"] == 64
    with pytest.raises(InvalidRequest, match="prompt has [0-9]+ tokens, media included; the model's context is 64 tokens"):
        asyncio.run(core.generate(None, reader(_chat(None, words=80)), "long"))
    with pytest.raises(InvalidRequest, match="context of 64 tokens"):
        asyncio.run(core.generate(None, reader(_chat(60)), "too_many_tokens"))
    asyncio.run(core.generate(None, reader(_chat(None)), "fits"))
    (pending,) = llm.calls
    assert len(pending.prompt_token_ids) + pending.sampling.max_tokens == 64  # max_tokens: the rest of the 64


def test_the_cli_takes_a_positive_max_model_len_only(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--max-model-len", "0"])
    assert e.value.code == 2 and "'0' is not a positive integer" in capsys.readouterr().err
