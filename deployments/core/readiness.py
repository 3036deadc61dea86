"""Readiness: whether the app can serve yet, as a Router replica sees it.

A Router replica takes requests as soon as its own constructor returns, while the LLM (and
Encoder) replicas are still loading their weights and running their warm-up forward in theirs:
tens of seconds for a real model. A handle call reaches a replica only after its constructor
returned, so a backend that has answered one call has a replica that is loaded and warm.
`Readiness` asks each backend the app needs (`ready()`, through the handle the requests use,
which starts that handle's routing too) until it answers, again after a failure or a timeout;
the Router replica is ready once every one has answered.

It then stays ready. Replicas lost later are for Serve's health checks and the router's
failover; a readiness that followed them would have to ask through the same queues as the
requests, and a probe stuck behind busy replicas would take every pod out of rotation at the
moment the app is busiest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

logger = logging.getLogger("ray.serve")


class Readiness:
    """Watches `backends` (name -> a call that answers once that backend has a replica up) until
    each has answered once; on the event loop of the replica (`start` where one runs)."""

    def __init__(self, backends: Mapping[str, Callable[[], Awaitable[object]]], retry_s: float = 1.0,
                 attempt_timeout_s: float = 30.0):
        self._backends = dict(backends)
        self._waiting = list(self._backends)  # not answered yet, in the order given
        self._retry_s, self._attempt_timeout_s = retry_s, attempt_timeout_s
        self._tasks: list[asyncio.Task] = []
        self._answered = asyncio.Event()  # (binds to a loop on first use)
        if not self._waiting:
            self._answered.set()

    @property
    def ready(self) -> bool:
        return not self._waiting

    @property
    def waiting_for(self) -> tuple[str, ...]:
        return tuple(self._waiting)

    def reason(self) -> str:
        """What a 503 says while not ready ("" once ready)."""
        if not self._waiting:
            return ""
        names = " and ".join(f"the {name} deployment" for name in self._waiting)
        return f"not ready: waiting for a replica of {names} to load its model and warm up"

    def start(self) -> None:
        """Start asking, on the running event loop; nothing when none runs or it has started."""
        if self._tasks or not self._waiting:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._tasks = [loop.create_task(self._watch(name)) for name in self._waiting]

    async def wait(self, timeout_s: float) -> bool:
        """Whether ready within `timeout_s` (asking starts here if it has not)."""
        self.start()
        if not self._waiting:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._answered.wait()), timeout_s)
        return self.ready

    async def _watch(self, name: str) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                await asyncio.wait_for(self._backends[name](), self._attempt_timeout_s)
                break
            except asyncio.TimeoutError:  # no replica up yet (a handle call waits for one): ask again
                logger.info("readiness: the %s deployment has not answered in %.0fs", name, self._attempt_timeout_s)
            except Exception as e:  # a replica lost mid-call, a deployment not deployed yet
                log = logger.info if attempt in (1, 10) or attempt % 100 == 0 else logger.debug
                log("readiness: asking the %s deployment failed (%r); asking again", name, e)
                await asyncio.sleep(self._retry_s)
        self._waiting.remove(name)
        logger.info("readiness: the %s deployment answered", name)
        if not self._waiting:
            logger.info("readiness: ready")
            self._answered.set()
