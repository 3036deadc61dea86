"""Drive an `LLMEngine` step by step (no thread) on requests planned and encoded like the app's."""

from __future__ import annotations

import functools

from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine, LLMRequest, TokenEvent
from llm_service.model.language_model import LanguageModel
from tests.support.cases import cases, image, image_question, text, user, video
from tests.support.pipeline import plan_request  # noqa: F401  (re-exported for the engine tests)
from tests.support.reference import reference_generate


@functools.lru_cache(maxsize=4)
def language_model(model_dir: str) -> LanguageModel:
    return LanguageModel(model_dir, dtype="float64")


def make_engine(model_dir: str, **config) -> LLMEngine:
    return LLMEngine(language_model(model_dir), EngineConfig(**config))


def image_prompt(seed: int, question: str = "Describe this picture in detail, please.") -> list[dict]:
    """A 112 x 112 image (16 image tokens, the same ids for any seed), then `question`."""
    return image_question(image(112, 112, seed), question=question)


class Collector:
    """Events of every request, by request id."""

    def __init__(self):
        self.events: dict[str, list[TokenEvent]] = {}

    def add(self, engine: LLMEngine, request: LLMRequest) -> None:
        self.events[request.request_id] = []
        engine.add_request(request, self.events[request.request_id].append)

    def done(self, request_id: str) -> bool:
        evs = self.events[request_id]
        return bool(evs) and evs[-1].finish_reason is not None

    def all_done(self) -> bool:
        return all(self.done(r) for r in self.events)

    def tokens(self, request_id: str) -> list[int]:
        return [e.token_id for e in self.events[request_id] if e.token_id is not None]

    def finish_reason(self, request_id: str) -> str | None:
        return self.events[request_id][-1].finish_reason


def run_until_done(engine: LLMEngine, collector: Collector, max_steps: int = 10_000) -> int:
    steps = 0
    while not collector.all_done():
        engine.step()
        steps += 1
        assert steps < max_steps, "engine made no progress"
    return steps


@functools.lru_cache(maxsize=256)
def _reference(model_dir: str, case: str, index: int, max_tokens: int) -> tuple[int, ...]:
    return tuple(reference_generate(model_dir, mixed_cases()[index][1], max_tokens))


def reference_tokens(model_dir: str, index: int, max_tokens: int) -> list[int]:
    return list(_reference(model_dir, mixed_cases()[index][0], index, max_tokens))


@functools.lru_cache(maxsize=1)
def mixed_cases() -> list[tuple[str, list[dict]]]:
    """18 mixed prompts: the equivalence cases plus text, image and video variants."""
    out = list(cases().items())
    out += [(f"text_{i}", user(text("Count " * (i * 7 + 1) + str(i)))) for i in range(6)]
    out += [(f"image_{i}", user(image(56 + 14 * i, 84 - 7 * i, 40 + i), text(f"What is {i}?"))) for i in range(4)]
    out += [(f"video_{i}", user(video(2 + 2 * i, 56, 56, 50 + i, fps=2.0), text("Go."))) for i in range(2)]
    return out
