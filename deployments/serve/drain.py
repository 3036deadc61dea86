"""Graceful shutdown: stop admitting, let the requests in flight finish, then stop.

`mmserve serve` (on SIGTERM or Ctrl-C) marks each of its applications as draining in Ray's
key-value store. Every Router replica watches that mark: while it is set, new requests get
503 / UNAVAILABLE ("server is shutting down") and `/health` answers 503, so load balancers
stop sending, while the streams already admitted run to their end. The command waits until no
Router replica has a request in flight (or the grace period is over), then shuts Serve and Ray
down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

logger = logging.getLogger("ray.serve")
NAMESPACE = "mmserve_drain"
POLL_S = 0.25  # how soon a Router replica sees the mark


def set_draining(app_name: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(app_name.encode(), b"1", overwrite=True, namespace=NAMESPACE)


def is_draining(app_name: str) -> bool:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(app_name.encode(), namespace=NAMESPACE) is not None


class DrainWatch:
    """A Router replica's view of the mark, refreshed every `POLL_S` by a task on its event loop."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.draining = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self.draining:
            try:
                self.draining = await asyncio.to_thread(is_draining, self.app_name)
            except Exception as e:  # a GCS hiccup: keep serving, look again
                logger.debug("drain mark unreadable: %r", e)
            await asyncio.sleep(POLL_S)
        logger.info("application %s is draining: new requests get 503", self.app_name)


def requests_in_flight(app_name: str, deployment: str = "Router") -> int:
    """Requests running on `deployment`'s replicas of `app_name` (streams included)."""
    import ray

    total = 0
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if f"{app_name}#{deployment}#" in actor["name"]:
            with contextlib.suppress(Exception):  # a replica that is gone holds nothing
                replica = ray.get_actor(actor["name"], namespace=actor["namespace"])
                total += ray.get(replica.get_num_ongoing_requests.remote(), timeout=5)
    return total


def drain(app_names: list[str], grace_s: float) -> int:
    """Marks `app_names` draining and waits up to `grace_s` for their requests to finish; returns
    how many were still in flight when it stopped waiting."""
    for name in app_names:
        set_draining(name)
    deadline = time.monotonic() + grace_s
    time.sleep(2 * POLL_S)  # every router has seen the mark: nothing new is admitted after this
    while True:
        left = sum(requests_in_flight(name) for name in app_names)
        if left == 0 or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)
