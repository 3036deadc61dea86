"""Engine liveness on its own thread: a failed step fails only its sequences; `health` reports a
dead engine thread and a stall while holding work."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.engine_support import Collector, make_engine, mixed_cases, plan_request


def _wait(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _text_request(model_dir: str, request_id: str, max_tokens: int = 4):
    return plan_request(model_dir, mixed_cases()[0][1], request_id, max_tokens, ignore_eos=True)


def test_a_failed_step_fails_only_its_sequences(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir, max_num_seqs=1)  # one sequence per step: "b" waits while "a" runs
    run, calls = engine.runner.run, []

    def failing_once(step):
        calls.append([item.seq.request_id for item in step.scheduled])
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return run(step)

    engine.runner.run = failing_once
    collector = Collector()
    collector.add(engine, _text_request(model_dir, "a"))
    collector.add(engine, _text_request(model_dir, "b"))
    engine.start()
    try:
        _wait(collector.all_done)
    finally:
        engine.shutdown()
    assert calls[0] == ["a"]
    assert collector.finish_reason("a") == "error" and "injected" in str(collector.events["a"][-1].error)
    assert collector.finish_reason("b") == "length" and len(collector.tokens("b")) == 4
    first, *rest = collector.events["b"]  # only the first event says how long it waited for its first step
    assert first.stages["prefill_queue_ms"] >= 0 and all(e.stages is None for e in rest)
    assert engine.scheduler.blocks.num_used_blocks == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_health_reports_a_stalled_engine_and_a_dead_thread(tiny_models):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir)
    release = threading.Event()
    run = engine.runner.run

    def stuck(step):
        release.wait(30)
        return run(step)

    engine.runner.run = stuck
    engine.start()
    assert engine.health(stall_timeout_s=0.2) is None  # idle: no work, no stall
    time.sleep(0.3)
    assert engine.health(stall_timeout_s=0.2) is None  # idle for long is fine
    collector = Collector()
    collector.add(engine, _text_request(model_dir, "a"))
    assert engine.health(stall_timeout_s=0.2) is None  # the stall clock starts with the work
    time.sleep(0.4)
    assert "made no step" in engine.health(stall_timeout_s=0.2)
    release.set()
    _wait(collector.all_done)
    assert engine.health(stall_timeout_s=0.2) is None

    class Fatal(BaseException):
        pass

    def die():
        raise Fatal()

    engine.step = die
    collector.add(engine, _text_request(model_dir, "b"))
    _wait(lambda: not engine._thread.is_alive(), 10)
    assert engine.health(stall_timeout_s=60) == "the engine thread is dead"
