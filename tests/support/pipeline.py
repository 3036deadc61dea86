"""Router -> encoder runtime -> LLM runtime in one process (no Ray), for equivalence tests."""

from __future__ import annotations

import queue
from collections import OrderedDict

from encoder_service import VisionEncoder
from llm_service.engine.llm_engine import LLMEngine, LLMRequest
from llm_service.model.language_model import LanguageModel
from llm_service.sampling import SamplingParams
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.request.prompt_plan import Message, RequestPlanner


_RUNTIMES: OrderedDict[tuple[str, str], tuple] = OrderedDict()
_KEPT = 2


def runtimes(model_dir: str, dtype: str = "float64"):
    """(planner, encoder, started engine) of `model_dir`, kept for the last few checkpoints; the
    one pushed out has its engine shut down (a running engine thread keeps its model and KV pool
    alive: an `lru_cache` here held every family's for the whole session, GBs by the end)."""
    from transformers import AutoTokenizer

    key = (str(model_dir), dtype)
    if key in _RUNTIMES:
        _RUNTIMES.move_to_end(key)
        return _RUNTIMES[key]
    while len(_RUNTIMES) >= _KEPT:
        _, (_, _, old) = _RUNTIMES.popitem(last=False)
        old.shutdown()
    planner = RequestPlanner(model_dir, AutoTokenizer.from_pretrained(model_dir))
    encoder = VisionEncoder(model_dir, dtype=dtype)
    engine = LLMEngine(LanguageModel(model_dir, dtype=dtype))
    engine.start()
    _RUNTIMES[key] = planner, encoder, engine
    return _RUNTIMES[key]


def to_planner_messages(messages: list[dict]) -> list[Message]:
    """The planner's messages of test messages (transformers' chat shape, media as bytes); an
    assistant's `tool_calls` (`ToolCall`s) and a tool result's `tool_call_id` pass through."""
    out = []
    for m in messages:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                parts.append(MediaItem(MediaKind.IMAGE, (p["bytes"],)))
            elif p["type"] == "video":
                parts.append(MediaItem(MediaKind.VIDEO, tuple(p["frames"]), fps=p.get("fps", 2.0)))
            else:
                parts.append(p["text"])
        out.append(Message(m["role"], tuple(parts), tuple(m.get("tool_calls", ())), m.get("tool_call_id")))
    return out


def plan_request(model_dir: str, messages: list[dict], request_id: str, max_tokens: int, tools=(),
                 **sampling) -> LLMRequest:
    """What the router and the encoder make of `messages`: a request ready for the engine (`tools`:
    the `ToolSpec`s described to the model, as the app passes them unless `tool_choice` is none)."""
    planner, encoder, _ = runtimes(model_dir)
    plan = planner.plan(to_planner_messages(messages), tuple(tools))
    embeddings = encoder.encode(plan.media) if plan.items else []
    return LLMRequest(
        request_id=request_id,
        prompt_token_ids=tuple(plan.token_ids),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        positions=plan.positions,
        media=tuple(zip(plan.ranges, embeddings)),
        snapshot_boundaries=plan.snapshot_boundaries,
    )


def submit(model_dir: str, messages: list[dict], max_tokens: int, request_id: str = "r", **sampling):
    """Plan, encode and admit one request; returns the queue its TokenEvents arrive on."""
    _, _, engine = runtimes(model_dir)
    request = plan_request(model_dir, messages, request_id, max_tokens, **sampling)
    events: queue.Queue = queue.Queue()
    engine.add_request(request, events.put)
    return events


def collect(events: queue.Queue, timeout: float = 120) -> tuple[list[int], str]:
    tokens = []
    while True:
        ev = events.get(timeout=timeout)
        if ev.error:
            raise ev.error
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        if ev.finish_reason:
            return tokens, ev.finish_reason


def served_generate(model_dir: str, messages: list[dict], max_tokens: int) -> list[int]:
    return collect(submit(model_dir, messages, max_tokens))[0]
