"""The soak's parts: its good and bad requests, a client that records what came back, replica
kills while requests run, a burst. `bench/soak.py` runs them for minutes;
`tests/serve/test_failover_serve.py` runs the smallest soak (a few dozen requests, kills) in the suite.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from mmserve.loadgen.dataset import data_uri, image_bytes


# -- the requests: good ones (greedy, text and 1-2 images of varied sizes, streaming or not) and bad
# inputs of many kinds, each of which must get a 4xx naming the problem
MAX_TOKENS = 40  # long enough that a stream can be caught with >= 2 tokens sent and >= 8 left
SIZES = [(64, 64), (120, 160), (224, 224), (300, 200), (480, 360), (640, 480)]
TOPICS = ["the weather", "a red bicycle", "three cats", "the harbour at night", "a chess game", "an old map"]


@dataclass(frozen=True)
class SoakRequest:
    index: int
    good: bool
    stream: bool
    body: dict | None  # None: send `raw` as the body
    raw: bytes | None = None
    kind: str = "good"  # for bad inputs: what is wrong with it
    images: int = 0


def good_request(index: int, rng: random.Random, light: bool = False) -> SoakRequest:
    """A greedy request; `light` ones (the unloaded and burst phases) have at most one small image."""
    images = rng.choice([0, 1]) if light else rng.choices([0, 1, 2], weights=[4, 4, 2])[0]
    sizes = SIZES[:3] if light else SIZES
    content = [{"type": "image_url", "image_url": {"url": data_uri(image_bytes(*rng.choice(sizes), seed=seed))}}
               for seed in range(1000 * index, 1000 * index + images)]
    content.append({"type": "text", "text": f"request {index}: tell me about {rng.choice(TOPICS)}"})
    stream = rng.random() < 0.7
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    return SoakRequest(index, True, stream, body, images=images)


def _chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _url(url: str) -> dict:
    return _chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}])


def bad_inputs() -> list[tuple[str, dict | None, bytes | None]]:
    """(kind, body, raw body) of every kind of bad input the soak sends."""
    png = image_bytes(32, 32, seed=1)
    tiny = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(8, 8, seed=2))}}
    return [
        ("invalid JSON", None, b'{"messages": [oops'),
        ("not an image", _url(data_uri(b"hello, world")), None),
        ("truncated PNG", _url(data_uri(png[: len(png) // 2])), None),
        ("file URL", _url("file:///etc/passwd"), None),
        ("local path", _url("/etc/passwd"), None),
        ("ftp URL", _url("ftp://example.com/cat.png"), None),
        ("gopher URL", _url("gopher://example.com/1"), None),
        ("loopback http URL", _url("http://127.0.0.1:8265/"), None),
        ("too many images", _chat([tiny] * 40 + [{"type": "text", "text": "many"}]), None),
        ("unknown model", {**_chat("hi"), "model": "no-such-model"}, None),
        ("temperature -1", _chat("hi", temperature=-1), None),
        ("seed 2**64", _chat("hi", seed=2**64), None),
        ("max_tokens over context", _chat("hi", max_tokens=10**7), None),
        ("unknown content part", _chat([{"type": "audio_url", "audio_url": {"url": "x"}}]), None),
        ("no messages", {"messages": [], "max_tokens": 4}, None),
        ("n = 99", _chat("hi", n=99), None),
        ("bad base64", _url("data:image/png;base64,!!!not-base64!!!"), None),
        ("top_p 0", _chat("hi", top_p=0), None),
    ]


def soak_requests(count: int, bad_share: float, seed: int) -> list[SoakRequest]:
    rng, bad = random.Random(seed), bad_inputs()
    return [SoakRequest(i, False, False, body, raw, kind) if rng.random() < bad_share else good_request(i, rng)
            for i, (kind, body, raw) in ((i, bad[i % len(bad)]) for i in range(count))]


def encode(request: SoakRequest) -> bytes:
    return request.raw if request.body is None else json.dumps(request.body).encode()


@dataclass
class Result:
    status: int = 0
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    message: str = ""
    json_error: bool = False
    seconds: float = 0.0  # until the response ended


def send(client: httpx.Client, url: str, req: SoakRequest, live: dict[int, list[int]] | None = None) -> Result:
    """One request; a stream's tokens so far are visible in `live[req.index]` while it runs."""
    out = Result()
    start = time.perf_counter()
    headers = {"content-type": "application/json"}
    try:
        with client.stream("POST", url, content=encode(req), headers=headers, timeout=300) as resp:
            out.status = resp.status_code
            if resp.status_code != 200 or not req.stream:
                body = resp.read()
                try:
                    data = json.loads(body)
                except ValueError:
                    out.message = body[:200].decode(errors="replace")
                    return out
                if resp.status_code == 200:
                    out.tokens = list(data["choices"][0].get("token_ids") or [])
                else:
                    out.message = str(data.get("error", {}).get("message", ""))
                    out.json_error = bool(out.message)
                return out
            if live is not None:
                live[req.index] = out.tokens
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.status, out.message = 599, str(event["error"])  # failed mid-stream
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids and out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - start
                    out.tokens.extend(ids)
    except Exception as e:  # a hang or a dropped connection: the request is lost
        out.status, out.message = 598, repr(e)
    finally:
        if live is not None:
            live.pop(req.index, None)
        out.seconds = time.perf_counter() - start
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# -- replicas --------------------------------------------------------------------------------
def replicas(app: str, deployment: str) -> list:
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#{deployment}#" in a["name"]]


def ongoing(replica, timeout_s: float = 0.5) -> int:
    """Requests `replica` holds; 0 when it does not answer within `timeout_s` (a replica killed
    earlier may still be listed, and a poll that waited seconds on it let the soak end unkilled)."""
    import ray

    try:
        return ray.get(replica.get_num_ongoing_requests.remote(), timeout=timeout_s)
    except Exception:
        return 0


def replica_rss_mb(app: str) -> dict[str, float]:
    """{replica name: RSS in MB} of every replica of the app."""
    import psutil
    import ray

    rss = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"{app}#" not in actor["name"]:
            continue
        try:
            handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
            pid = ray.get(handle.__ray_call__.remote(lambda _: os.getpid()), timeout=10)
            rss[actor["name"].split("::")[-1]] = psutil.Process(pid).memory_info().rss / 2**20
        except Exception:  # a replica that is gone (or going) has no RSS to report
            continue
    return rss


class Faults:
    """Kills one encoder replica (holding encode calls) after `encoder_at` requests started, and one
    LLM replica (with streams mid-way) after `llm_at`; new requests wait at `gate` meanwhile."""

    def __init__(self, app: str, encoder_at: int, llm_at: int, live: dict[int, list[int]]):
        self.app = app
        self.encoder_at, self.llm_at, self.live = encoder_at, llm_at, live
        self.started = self.finished = 0  # requests admitted / answered
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.report: dict = {}

    def admit(self) -> None:
        self.gate.wait()
        with self.lock:
            self.started += 1

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # a failed kill must show in the report, not end the thread silently
            self.report["error"] = repr(e)
        finally:
            self.gate.set()

    def _run(self) -> None:
        import ray

        while self.started < self.encoder_at and not self.done.is_set():
            time.sleep(0.01)
        # until the LLM's turn: a short run may see no encode call held at a poll
        encoders = replicas(self.app, "Encoder")  # looked up once: each poll is then one call per replica
        while not self.done.is_set() and "encoder_held" not in self.report and self.started < self.llm_at:
            for victim in encoders:
                if held := ongoing(victim):
                    ray.kill(victim, no_restart=False)
                    self.report.update(encoder_held=held, encoder_killed_after=self.started)
                    break
            time.sleep(0.002)
        while self.started < self.llm_at and not self.done.is_set():
            time.sleep(0.01)
        llms = replicas(self.app, "LLM")
        give_up_at = time.monotonic() + 1.0  # then any in-flight request will do (see below)
        while not self.done.is_set() and "llm_held" not in self.report:
            self.gate.clear()  # new requests wait until the kill
            if time.monotonic() > give_up_at and llms and self.started > self.finished:
                # no poll saw a replica hold a request (CI, twice): kill one while requests are in
                # flight all the same; what it held runs again elsewhere, what it did not is untouched
                ray.kill(llms[0], no_restart=False)
                self.report.update(llm_held=0, llm_streams_mid_way=0, llm_killed_after=self.started,
                                   llm_killed_blind=True)
                break
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                # a stream mid-way is best (it resumes on another replica); else any request the
                # replica holds (one not streamed, or a stream whose tokens came in one burst, is
                # retried whole): waiting for a stream seen mid-way missed on a loaded machine
                # (tiny models stream 40 tokens in a few SSE events)
                mid_way = sum(2 <= len(t) <= MAX_TOKENS - 8 for t in list(self.live.values()))
                held, victim = max(((ongoing(v), v) for v in llms), key=lambda pair: pair[0], default=(0, None))
                if victim is not None and (held or mid_way):
                    ray.kill(victim, no_restart=False)
                    self.report.update(llm_held=held, llm_streams_mid_way=mid_way, llm_killed_after=self.started)
                    break
                if not self.live:
                    break  # nothing running: let a few more requests in and look again
                time.sleep(0.002)
            self.gate.set()
            time.sleep(0.05)


def run_all(url: str, requests: list[SoakRequest], concurrency: int, faults: Faults | None = None,
            live: dict | None = None) -> list[Result]:
    results: list[Result | None] = [None] * len(requests)

    def one(i: int) -> None:
        if faults:
            faults.admit()
        with httpx.Client() as client:
            results[i] = send(client, url, requests[i], live)
        if faults:
            with faults.lock:
                faults.finished += 1

    with ThreadPoolExecutor(concurrency) as pool:
        for n, _ in enumerate(pool.map(one, range(len(requests))), 1):
            if n % 50 == 0:
                print(f"  {n}/{len(requests)} done", flush=True)
    return results


def burst(url: str, count: int, seed: int) -> list[Result]:
    """`count` streaming requests sent at once from one event loop (threads would spend the
    client's CPU, on the same cores as the server, on switching)."""
    import asyncio

    rng = random.Random(seed)
    bodies = [encode(SoakRequest(i, True, True, {**good_request(10_000 + i, rng, light=True).body, "stream": True}))
              for i in range(count)]

    async def one(client: httpx.AsyncClient, body: bytes) -> Result:
        out = Result()
        start = time.perf_counter()
        try:
            async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
                out.status = resp.status_code
                async for line in resp.aiter_lines():
                    if out.ttft_s is None and line.startswith("data: {") and '"token_ids":[' in line.replace(" ", ""):
                        out.ttft_s = time.perf_counter() - start
        except Exception as e:
            out.status, out.message = 598, repr(e)
        out.seconds = time.perf_counter() - start
        return out

    async def main() -> list[Result]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            return list(await asyncio.gather(*(one(client, b) for b in bodies)))

    return asyncio.run(main())


def burst_summary(shot: list[Result], unloaded_p99_ms: float) -> dict:
    admitted = [r.ttft_s * 1000 for r in shot if r.status == 200 and r.ttft_s is not None]
    return {
        "burst_admitted": len(admitted), "shed_429": sum(r.status == 429 for r in shot),
        "shed_p50_ms": round(pct([r.seconds * 1000 for r in shot if r.status == 429], 50), 1),
        "shed_p99_ms": round(pct([r.seconds * 1000 for r in shot if r.status == 429], 99), 1),
        "burst_other_statuses": sorted({r.status for r in shot} - {200, 429}),
        "loaded_p50_ttft_ms": round(pct(admitted, 50), 1), "loaded_p99_ttft_ms": round(pct(admitted, 99), 1),
        "p99_ttft_loaded_vs_unloaded": round(pct(admitted, 99) / unloaded_p99_ms, 2),
    }


@dataclass
class SoakOutcome:
    """What a soak saw: `lost` good requests (not 200), `wrong` ones (tokens differ from the
    reference run), `unclean` bad inputs (not a 4xx with a JSON error message) as (kind, status,
    message), and what the faults did."""

    reference_s: float
    soak_s: float
    lost: list[SoakRequest]
    wrong: list[SoakRequest]
    unclean: list[tuple[str, int, str]]
    results: list[Result]
    faults: dict


def soak(url: str, app: str, requests: list[SoakRequest], concurrency: int, encoder_at: float = 0.3,
         llm_at: float = 0.6, before_faults=None) -> SoakOutcome:
    """Every good request once with no fault (the reference outputs; each must be 200), then all of
    `requests` at `concurrency` while one encoder replica (after `encoder_at` of the requests
    started) and one LLM replica (after `llm_at`) of `app` are killed. `before_faults()` runs
    between the two (e.g. to sample RSS)."""
    good = [r for r in requests if r.good]
    t = time.perf_counter()
    reference = dict(zip((r.index for r in good), run_all(url, good, concurrency)))
    reference_s = time.perf_counter() - t
    unusable = [i for i, r in reference.items() if r.status != 200]
    assert not unusable, (f"reference run (no fault) failed for {len(unusable)} requests: "
                          f"{reference[unusable[0]].status} {reference[unusable[0]].message}")
    if before_faults:
        before_faults()
    live: dict[int, list[int]] = {}
    faults = Faults(app, int(encoder_at * len(requests)), int(llm_at * len(requests)), live)
    killer = threading.Thread(target=faults.run, daemon=True)
    killer.start()
    t = time.perf_counter()
    results = run_all(url, requests, concurrency, faults, live)
    soak_s = time.perf_counter() - t
    faults.done.set()
    killer.join(timeout=30)
    lost = [r for r in requests if r.good and results[r.index].status != 200]
    wrong = [r for r in requests if r.good and results[r.index].status == 200
             and results[r.index].tokens != reference[r.index].tokens]
    unclean = [(r.kind, results[r.index].status, results[r.index].message[:80]) for r in requests
               if not r.good and not (400 <= results[r.index].status < 500 and results[r.index].json_error)]
    return SoakOutcome(reference_s, soak_s, lost, wrong, unclean, results, dict(faults.report))
