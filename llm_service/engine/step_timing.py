"""Where each engine step's time goes (`LLMEngine.step_log`: `bench/llm.py --breakdown`, `--grammar`)."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class StepTimes(NamedTuple):
    """Where one `step()` call's host time went, in seconds (`LLMEngine.step_log`): scheduling
    (admission included), preparing the inputs, launching the forward (on the CPU: running it),
    launching the sampler, waiting for the sampled ids read here, postprocessing them (stop
    checks, events); `device`: CUDA-event time from the forward's launch to the sampler's end
    of the step read here (None off CUDA). With overlap the step launched and the step read
    are consecutive ones; a step with constrained rows reads the one before it between its
    forward and its sampler (`readback` and `postprocess` then, not `sample`)."""

    schedule: float
    prepare: float
    launch: float
    sample: float
    readback: float
    postprocess: float
    device: float | None
    num_seqs: int
    num_tokens: int
    decode_only: bool


PHASES = StepTimes._fields[:6]


class StepClock:
    """Times the steps while `log` is a list: `start` and `stop` go around a step, which says
    where its time goes from each point on (`enter`); `stop` adds its `StepTimes` to `log` when it
    launched or read anything."""

    def __init__(self):
        self.log: list[StepTimes] | None = None
        self.start()

    def start(self) -> None:
        self._spent = dict.fromkeys(PHASES, 0.0)
        self._phase: str | None = "schedule"
        self._since = time.perf_counter()
        self._read = False
        self._device: float | None = None

    def enter(self, phase: str | None) -> str | None:
        """The time from now on goes to `phase` (None: to none); returns the phase it left."""
        now = time.perf_counter()
        if self._phase is not None:
            self._spent[self._phase] += now - self._since
        left, self._phase, self._since = self._phase, phase, now
        return left

    def device_start(self, device: torch.device) -> torch.cuda.Event | None:
        """Recorded before a forward (only while the steps are logged, on CUDA): `read` times the
        step from there to its `done` event."""
        if self.log is None or device.type != "cuda":
            return None
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        return began

    def read(self, began: torch.cuda.Event | None, done: torch.cuda.Event | None, resume: str | None) -> None:
        """A launched step was read and postprocessed (its device time, from `device_start`);
        the time goes back to `resume`."""
        self.enter(resume)
        self._read = True
        self._device = began.elapsed_time(done) / 1000 if began is not None else None

    def stop(self, scheduled) -> None:
        if self.log is not None and (scheduled or self._read):
            decode_only = bool(scheduled) and all(n == 1 for _, n in scheduled)
            self.log.append(StepTimes(*self._spent.values(), self._device, len(scheduled),
                                      sum(n for _, n in scheduled), decode_only))
