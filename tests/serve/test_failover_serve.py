"""Lossless failover in real Serve apps, replicas killed with `ray.kill`.

With two LLM and two encoder replicas: an LLM replica killed while every stream is mid-way, and
an encoder replica killed with items queued on it. With one of each: requests wait for the
replacement. Every request completes with the output it had before any fault (greedy, float64).
The encoders' caches are off, so every run encodes again."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.support.media_factory import data_uri, image_bytes
from tests.support.serve_fixtures import _app_args

pytestmark = pytest.mark.serve
APP = "failover"
SINGLE = "failover1"
MAX_TOKENS = 160  # streams long enough that the slowest has begun before the fastest ends (decode is fast)


NO_CACHE = {"cache_bytes": 0}


def _deploy(serve_ports, model_dir: str, app: str, replicas: int) -> str:
    from ray import serve

    from deployments.serve.app import build_app

    group = {"num_replicas": replicas, "num_cpus": 0.1}  # affinity on: killing an owner must lose nothing too
    args = _app_args(model_dir, app, llm=group, encoder=group, encoder_pool=NO_CACHE, llm_retries=2,
                     routing={"policy": "affinity"})
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    return f"http://127.0.0.1:{serve_ports[0]}/{app}/v1/chat/completions"


@pytest.fixture(scope="module")
def failover_url(serve_ports, tiny_models):
    from ray import serve

    yield _deploy(serve_ports, tiny_models["qwen2_vl"], APP, replicas=2)
    serve.delete(APP)


@pytest.fixture(scope="module")
def single_url(serve_ports, tiny_models):
    from ray import serve

    yield _deploy(serve_ports, tiny_models["qwen2_vl"], SINGLE, replicas=1)
    serve.delete(SINGLE)


def _bodies() -> list[dict]:
    bodies = []
    for i in range(6):
        content = [{"type": "text", "text": f"request {i}: describe the weather in city {i * 7}"}]
        if i % 2:  # every other request carries an image
            content.insert(0, {"type": "image_url", "image_url": {"url": data_uri(image_bytes(32 + 8 * i, 40, seed=i))}})
        bodies.append({
            "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
        })
    return bodies


def _stream(url: str, body: dict, tokens: list[int], errors: list[str]) -> None:
    try:
        with httpx.stream("POST", url, json=body, timeout=120) as resp:
            if resp.status_code != 200:
                errors.append(f"{resp.status_code}: {resp.read().decode()}")
                return
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(str(event["error"]))
                for choice in event.get("choices", []):  # (its choice, token): n > 1 interleaves them
                    tokens.extend((choice["index"], t) for t in choice.get("token_ids", []))
    except Exception as e:  # reported by the test
        errors.append(repr(e))


def _run_all(url: str, bodies: list[dict], while_running=None) -> tuple[list[list[int]], list[str], object]:
    outputs: list[list[int]] = [[] for _ in bodies]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream, args=(url, b, out, errors)) for b, out in zip(bodies, outputs)]
    for t in threads:
        t.start()
    result = while_running(outputs) if while_running else None
    for t in threads:
        t.join(timeout=180)
    return outputs, errors, result


def _replicas(app: str, deployment: str) -> list:
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#{deployment}#" in a["name"]]


def _ongoing(replica) -> int:
    import ray

    return ray.get(replica.get_num_ongoing_requests.remote())  # Serve's own probe of a replica's load


def _kill_llm_mid_stream(app: str, replicas: int):
    """Kills the LLM replica holding the most streams once every stream has sent >= 2 tokens and
    has >= 8 left; returns the number of requests it held, or None when the window was missed.

    Affinity routing may put every stream on one replica, and a replica killed by an earlier
    attempt may still be listed (restarting) beside its replacement: the replicas are read again
    until the ones listed hold every stream, so the victim is one that Serve routes to."""
    import ray

    def watch(outputs: list[list[int]]) -> int | None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            counts = [len(o) for o in outputs]
            # the furthest choice of each stream (n > 1 interleaves its choices' (choice, token) pairs)
            if any(max(Counter(c for c, _ in list(o)).values(), default=0) > MAX_TOKENS - 8 for o in outputs):
                return None  # missed the window
            if all(c >= 2 for c in counts):
                found = _replicas(app, "LLM")
                held = {}
                for replica in found:
                    try:
                        held[replica] = _ongoing(replica)
                    except Exception:  # a replica killed by an earlier attempt, gone meanwhile
                        pass
                if len(held) == replicas and sum(held.values()) == len(outputs):
                    victim = max(held, key=held.get)
                    ray.kill(victim, no_restart=False)
                    return held[victim]
            time.sleep(0.002)
        return None

    return watch


def _kill_encoder_with_queued_items(app: str):
    """Kills the first encoder replica seen holding encode calls; returns how many it held."""
    import ray

    def watch(outputs: list[list[int]]) -> int | None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(outputs):
            for victim in _replicas(app, "Encoder"):
                if held := _ongoing(victim):
                    ray.kill(victim, no_restart=False)
                    return held
            time.sleep(0.002)
        return None

    return watch


def _image_bodies(count: int, images: int) -> list[dict]:
    """Requests with several large images each: preprocessing keeps items queued on the encoders."""
    bodies = []
    for i in range(count):
        content = [{"type": "image_url", "image_url": {"url": data_uri(image_bytes(960 + 8 * j, 1000, seed=10 * i + j))}}
                   for j in range(images)]
        content.append({"type": "text", "text": f"request {i}: what do these show?"})
        bodies.append({"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0,
                       "ignore_eos": True, "stream": True, "return_token_ids": True})
    return bodies


def _stats(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=app).failover_stats.remote().result()


def _wait_until_whole(app: str, timeout_s: float = 180) -> None:
    """Until every deployment of `app` runs all its replicas and each LLM replica answers its load
    probe at once: a replica killed by an earlier run (or test) is replaced, and a watcher's probe
    of one still starting would wait for its constructor while the streams run out."""
    import ray
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        deployments = serve.status().applications[app].deployments
        if all(set(d.replica_states) == {"RUNNING"} for d in deployments.values()):
            want = deployments["LLM"].replica_states["RUNNING"]
            try:
                found = _replicas(app, "LLM")
                if len(found) == want and all(ray.get(r.get_num_ongoing_requests.remote(), timeout=2) == 0
                                              for r in found):
                    return
            except Exception:  # one gone or still starting
                pass
        time.sleep(0.5)
    pytest.fail(f"{app} did not come back whole: {serve.status().applications[app].deployments}")


def _with_fault(url: str, bodies: list[dict], watch, app: str, counter: str, tries: int = 10, also: str = ""):
    """(outputs, errors, what `watch` returned, increase of `counter`) of the first run in which the
    fault cost its replica requests (the Router's failover `counter` grew, and `also` if given).
    Every run must match. Each run starts with the app whole (`_wait_until_whole`)."""
    # A loaded machine may let the requests outrun the watcher, and calls only queued on a killed
    # encoder (not yet running) are re-run by Serve itself, re-encoding nothing: try again
    for _attempt in range(tries):
        _wait_until_whole(app)
        before = _stats(app)
        outputs, errors, held = _run_all(url, bodies, watch)
        after = _stats(app)
        grown = after[counter] - before[counter]
        if held and grown and (not also or after[also] > before[also]):
            return outputs, errors, held, grown
        assert not errors, errors
    pytest.fail("the fault never hit a replica holding requests")


def test_killing_an_llm_replica_mid_stream_loses_nothing(failover_url):
    bodies = _bodies()
    expected, errors, _ = _run_all(failover_url, bodies)  # recorded before any fault
    assert not errors, errors
    assert all(len(e) == MAX_TOKENS for e in expected)
    before = _stats(APP)
    # which streams the victim holds is up to the router: a run counts once one of them has an image
    outputs, errors, held, resumed = _with_fault(
        failover_url, bodies, _kill_llm_mid_stream(APP, 2), APP, "resumed_streams", tries=8, also="resumed_with_media"
    )
    assert not errors, errors
    assert outputs == expected  # greedy: the same tokens as the uninterrupted run, nothing lost
    after = _stats(APP)
    assert resumed == held, (held, after)  # every stream on the killed replica, and only those
    assert after["resumed_tokens"] - before["resumed_tokens"] >= 2 * resumed
    assert after["resumed_with_media"] > before["resumed_with_media"], after


def test_killing_an_llm_replica_mid_stream_resumes_every_choice_of_n_3(failover_url):
    """Requests of three choices (greedy: the three alike), their replica killed once every stream
    sent tokens: each unfinished choice resumes from its own tokens on the other replica
    (`failover.ChoiceStreams`), every choice ends as in the uninterrupted run."""
    bodies = [{**body, "n": 3} for body in _bodies()[:2]]
    expected, errors, _ = _run_all(failover_url, bodies)
    assert not errors, errors
    for tokens in expected:
        by_choice = [[t for c, t in tokens if c == i] for i in range(3)]
        assert all(len(t) == MAX_TOKENS for t in by_choice) and by_choice[0] == by_choice[1] == by_choice[2]
    outputs, errors, held, resumed = _with_fault(failover_url, bodies, _kill_llm_mid_stream(APP, 2), APP,
                                                 "resumed_streams", tries=8)
    assert not errors, errors
    assert [[t for c, t in o if c == i] for o in outputs for i in range(3)] == [  # each choice's, in order
        [t for c, t in e if c == i] for e in expected for i in range(3)]
    assert resumed >= held  # every choice of the victim's requests resumed on its own


def test_killing_an_encoder_replica_with_items_queued_loses_nothing(failover_url):
    bodies = _image_bodies(8, images=4)
    expected, errors, _ = _run_all(failover_url, bodies)
    assert not errors, errors
    outputs, errors, held, reencoded = _with_fault(
        failover_url, bodies, _kill_encoder_with_queued_items(APP), APP, "reencoded_items"
    )
    assert not errors, errors
    assert outputs == expected
    assert reencoded > 0 and held > 0


def test_with_one_replica_each_requests_wait_for_the_replacement(single_url):
    bodies = _bodies()[:3]
    expected, errors, _ = _run_all(single_url, bodies)
    assert not errors, errors
    outputs, errors, held, resumed = _with_fault(
        single_url, bodies, _kill_llm_mid_stream(SINGLE, 1), SINGLE, "resumed_streams"
    )
    assert not errors and outputs == expected and resumed == held == len(bodies)
    image_bodies = _image_bodies(3, images=4)
    expected, errors, _ = _run_all(single_url, image_bodies)
    assert not errors, errors
    outputs, errors, _, _ = _with_fault(
        single_url, image_bodies, _kill_encoder_with_queued_items(SINGLE), SINGLE, "reencoded_items"
    )
    assert not errors and outputs == expected


def _llm_counter(app: str, key: str, replicas: int) -> int:
    """`key` of the LLM replicas' stats, summed over `replicas` distinct replicas (the handle
    answers from one replica per call)."""
    from ray import serve

    handle, seen = serve.get_deployment_handle("LLM", app_name=app), {}
    for _ in range(50):
        stats = handle.stats.remote().result()
        seen[stats["replica"]] = stats[key]
        if len(seen) == replicas:
            break
    return sum(seen.values())


def test_killing_an_encoder_replica_mid_video_stream_loses_nothing(failover_url):
    """A video streamed through the pipeline whose frame group's encoder replica is killed: the
    LLM replica encodes that group again (its counter grows) and the tokens are the unfaulted ones."""
    from tests.support.media_factory import video_file

    pytest.importorskip("av")
    data = video_file(4, 30, 800, 800, seed=24)  # 8 sampled frames of 800x800: 4 groups, each resized on the encoder
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_uri(data, "video/mp4")}},
        {"type": "text", "text": "What happens in this video?"}]}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    expected, errors, _ = _run_all(failover_url, [body])
    assert not errors and len(expected[0]) == 6, errors
    for _attempt in range(10):  # the kill may miss the group encodes (they are short): try again
        before = _llm_counter(APP, "video_groups_reencoded", 2)
        outputs, errors, held = _run_all(failover_url, [body], _kill_encoder_with_queued_items(APP))
        assert not errors, errors
        assert outputs == expected
        if held and _llm_counter(APP, "video_groups_reencoded", 2) > before:
            return
    pytest.fail("the kill never hit an encoder replica holding a frame group")


def test_the_smallest_soak_loses_nothing_and_rejects_every_bad_input_cleanly(failover_url):
    """bench/soak.py's own run, small: good requests (text, 1-2 images, streamed or not) and bad
    inputs of every kind at concurrency 12 (above Serve's old Router queue bound of 8), replicas killed
    meanwhile; so that the soak cannot rot between its by-hand runs."""
    from mmserve.loadgen.soak import bad_inputs, soak, soak_requests

    requests = soak_requests(2 * len(bad_inputs()) + 18, bad_share=0.35, seed=3)
    outcome = soak(failover_url, APP, requests, concurrency=12, encoder_at=0.15, llm_at=0.4)
    assert sum(not r.good for r in requests) >= 8
    assert not outcome.lost, [(r.index, outcome.results[r.index].status, outcome.results[r.index].message[:120])
                              for r in outcome.lost]
    assert not outcome.wrong and not outcome.unclean, (outcome.wrong, outcome.unclean)
    assert {"encoder_held", "llm_held"} & set(outcome.faults), outcome.faults  # at least one kill landed
