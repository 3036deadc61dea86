"""Tensor-parallel LLM replicas in a real Serve app (CPU, gloo, float64): `engine.tensor_parallel_size: 2`.

The app's answers over HTTP (streamed and not) and the public gRPC API equal `transformers`'
greedy tokens, each replica's other rank runs as a Ray actor in the replica's placement group; with
two replicas, killing one replica's rank under load loses no request (the replica ends as a whole,
its streams resume on the other one with the tokens of an uninterrupted run) and Serve brings the
replica back with a rank of its own."""

from __future__ import annotations

import time

import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.serve.test_failover_serve import MAX_TOKENS, _bodies, _ongoing, _run_all, _stats
from tests.support.cases import CASE_TOKENS, family_cases, openai_chat, proto_messages
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args

pytestmark = pytest.mark.serve
APP, FAILOVER = "tp2", "tp2failover"
TP = {"tensor_parallel_size": 2}


def _deploy(serve_ports, model_dir: str, app: str, llm_replicas: int) -> str:
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import wait_until_ready

    args = _app_args(model_dir, app, engine=TP, llm={"num_replicas": llm_replicas, "num_cpus": 0.1},
                     llm_retries=2)
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    wait_until_ready(app)
    return f"http://127.0.0.1:{serve_ports[0]}/{app}"


def _ranks(app: str) -> dict[str, list]:
    """{LLM replica id: its live rank actors' names} of `app`'s LLM replicas (Serve's replica names
    end with the replica id)."""
    import ray

    from deployments.serve.tp_ranks import RANK_ACTOR_PREFIX

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    replicas = [n.rsplit("#", 1)[1] for n in names if f"{app}#LLM#" in n]
    ranks = [n for n in names if n.startswith(RANK_ACTOR_PREFIX)]
    return {r: sorted(n for n in ranks if n.split("::")[1] == r) for r in replicas}


def _alive_rank_actors() -> int:
    import ray

    return sum(a["ActorClassName"].endswith("TPRank") and a["State"] == "ALIVE"
               for a in ray._private.state.actors().values())


@pytest.fixture(scope="module")
def tp_url(serve_ports, tiny_models):
    from ray import serve

    yield _deploy(serve_ports, tiny_models["qwen2_vl"], APP, llm_replicas=1)
    serve.delete(APP)


@pytest.mark.parametrize("case", ["text_only", "one_image"])
def test_tp2_http_and_grpc_equal_monolithic(tp_url, case, tiny_models, serve_ports):
    from ray import serve

    messages, max_tokens = family_cases("qwen2_vl")[case], CASE_TOKENS["qwen2_vl"]
    expected = reference_generate(tiny_models["qwen2_vl"], messages, max_tokens)
    text, tokens = openai_chat(tp_url, APP, messages, max_tokens, stream=False)
    assert tokens == expected
    assert openai_chat(tp_url, APP, messages, max_tokens, stream=True) == (text, tokens)
    with VLMClient(f"127.0.0.1:{serve_ports[1]}", application=APP) as c:
        unary = c.generate(proto_messages(messages), max_tokens=max_tokens)
        streamed = list(c.stream(proto_messages(messages), max_tokens=max_tokens))
    assert list(unary.token_ids) == expected and unary.text == text
    assert [t for r in streamed for t in r.token_ids] == expected
    stats = serve.get_deployment_handle("LLM", app_name=APP).stats.remote().result()
    assert stats["tensor_parallel_size"] == 2
    ranks = _ranks(APP)
    assert list(ranks) == [stats["replica"]] and len(ranks[stats["replica"]]) == 1  # rank 1 of the one replica
    assert _alive_rank_actors() >= 1


def _kill_a_rank_mid_stream(app: str, replicas: int, killed: list):
    """Kills rank 1 of the LLM replica holding the most streams once every stream has sent >= 2
    tokens and has >= 8 left (`killed`: that replica's id); returns how many requests it held, or
    None when the window was missed."""
    import ray

    def watch(outputs: list[list[int]]) -> int | None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            counts = [len(o) for o in outputs]
            if any(c > MAX_TOKENS - 8 for c in counts):
                return None
            if all(c >= 2 for c in counts):
                held = {}
                for a in ray.util.list_named_actors(all_namespaces=True):
                    if f"{app}#LLM#" in a["name"]:
                        try:  # Serve's replica names end with the replica's id
                            held[a["name"].rsplit("#", 1)[1]] = _ongoing(ray.get_actor(a["name"], a["namespace"]))
                        except Exception:  # a replica killed by an earlier attempt, gone meanwhile
                            pass
                if len(held) == replicas and sum(held.values()) == len(outputs):
                    victim = max(held, key=held.get)
                    [rank] = _ranks(app)[victim]
                    namespace = next(a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
                                     if a["name"] == rank)
                    ray.kill(ray.get_actor(rank, namespace=namespace), no_restart=True)
                    killed.append(victim)
                    return held[victim]
            time.sleep(0.002)
        return None

    return watch


def _wait_for_replicas(app: str, count: int, timeout_s: float = 180) -> dict[str, list]:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = serve.status().applications[app].deployments["LLM"].replica_states
        ranks = _ranks(app)
        if states == {"RUNNING": count} and len(ranks) == count and all(len(n) == 1 for n in ranks.values()):
            return ranks
        time.sleep(0.5)
    pytest.fail(f"the LLM replicas did not come back: {serve.status().applications[app].deployments['LLM']}")


def test_killing_a_rank_under_load_loses_nothing_and_the_replica_comes_back(serve_ports, tiny_models):
    from ray import serve

    url = _deploy(serve_ports, tiny_models["qwen2_vl"], FAILOVER, llm_replicas=2) + "/v1/chat/completions"
    try:
        bodies = _bodies()[:4]
        expected, errors, _ = _run_all(url, bodies)
        assert not errors, errors
        assert all(len(e) == MAX_TOKENS for e in expected)
        before_ranks = _wait_for_replicas(FAILOVER, 2)
        for _attempt in range(6):
            before, killed = _stats(FAILOVER), []
            outputs, errors, held = _run_all(url, bodies, _kill_a_rank_mid_stream(FAILOVER, 2, killed))
            assert not errors, errors
            assert outputs == expected  # greedy: the tokens of the uninterrupted run, nothing lost
            if held:
                break
            _wait_for_replicas(FAILOVER, 2)
        else:
            pytest.fail("the kill never hit a replica holding requests")
        after = _stats(FAILOVER)
        assert after["resumed_streams"] - before["resumed_streams"] == held  # the replica failed as a whole
        after_ranks = _wait_for_replicas(FAILOVER, 2)  # Serve replaced it, with a rank of its own
        assert killed[0] in before_ranks and killed[0] not in after_ranks
        outputs, errors, _ = _run_all(url, bodies)
        assert not errors and outputs == expected
        ranks_before_delete = _alive_rank_actors()
    finally:
        serve.delete(FAILOVER)
    deadline = time.monotonic() + 30
    while _alive_rank_actors() > ranks_before_delete - 2 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _alive_rank_actors() == ranks_before_delete - 2  # the replicas' shutdown ended their ranks
