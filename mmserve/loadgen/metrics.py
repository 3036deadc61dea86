"""Serving metrics from a recorded trace, with vLLM's `bench serve` field names where they overlap.

TTFT = first token - send; TPOT = (E2E - TTFT) / (output_tokens - 1) for requests with more than
one token; ITL = every gap between consecutive tokens of a request; E2E (vLLM's `e2el`) = last
token - send. Throughputs divide by the trace's duration (first send .. last finish). A request is
good when it completed and meets every SLO; failures (429s included) are never good.
Percentiles interpolate linearly, as numpy's default. `table` and `plots` show runs side by side.
"""

from __future__ import annotations

import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RequestRecord:
    """One request of a trace; times in seconds on one clock. `status` is the HTTP status (or a
    gRPC code name); `ok` is False for errors and 429s."""

    send_time: float
    end_time: float
    ok: bool
    status: str = "200"
    token_times: tuple[float, ...] = field(default_factory=tuple)
    input_tokens: int = 0
    stage_ms: dict[str, float] | None = None  # the server's usage.stage_ms (HTTP or gRPC), None where not reported

    def as_json(self, start: float) -> dict:
        """This request for --result-json: times in ms, `send_s` from `start`."""
        return {"send_s": round(self.send_time - start, 4), "status": self.status,
                "ttft_ms": round(self.ttft * 1000, 2) if self.ok and self.output_tokens else None,
                "e2e_ms": round((self.end_time - self.send_time) * 1000, 2), "output_tokens": self.output_tokens,
                "input_tokens": self.input_tokens, "stage_ms": self.stage_ms}

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.send_time

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, text: str | list[str] | None) -> "SLO":
        """`"ttft:500 tpot:50"` (or its words as a list) -> SLO; unknown keys are a ValueError."""
        values: dict[str, float] = {}
        for part in text.split() if isinstance(text, str) else text or ():
            key, sep, value = part.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"goodput SLO {part!r}: expected ttft:MS, tpot:MS or e2el:MS")
            values[f"{key}_ms"] = float(value)
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok or record.output_tokens == 0:
            return False
        return all((getattr(record, key) or 0.0) * 1000 <= limit for key, limit in self.as_dict().items())

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("e2el", self.e2el_ms)) if v is not None}


def from_unloaded(base: dict, slo: "SLO | None", rates: list[float] | None,
                  factors: tuple[float, ...]) -> tuple["SLO", list[float]]:
    """The SLOs (3 x an unloaded run's median TTFT and TPOT, unless `slo` is given) and the request
    rates (`factors` x one request at a time, unless `rates` are given) of a bench; printed."""
    slo = slo or SLO(ttft_ms=round(3 * base["median_ttft_ms"], 1), tpot_ms=round(3 * base["median_tpot_ms"], 1))
    rates = rates or [round(k * 1000 / base["mean_e2el_ms"], 3) for k in factors]
    print(f"SLOs: {' '.join(f'{k}:{v:g}ms' for k, v in slo.as_dict().items())}; request rates {rates}/s")
    return slo, rates


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else 0.0


def _summary(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0, f"median_{name}_ms": percentile(ms, 50),
            f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
            **{f"p{q:g}_{name}_ms": percentile(ms, q) for q in percentiles}}


def compute_metrics(records: list[RequestRecord], slo: SLO = SLO(), percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    if not records:
        raise ValueError("no requests in the trace")
    done = [r for r in records if r.ok and r.output_tokens > 0]
    start = min(r.send_time for r in records)
    end = max([r.end_time for r in records] + [r.token_times[-1] for r in done])
    duration = max(end - start, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in records if slo.met_by(r))
    statuses = dict(Counter(r.status for r in records))
    result = {
        "duration": duration,
        "num_prompts": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "rejected_429": statuses.get("429", 0) + statuses.get("RESOURCE_EXHAUSTED", 0),
        "statuses": statuses,
        "total_input_tokens": sum(r.input_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + sum(r.input_tokens for r in done)) / duration,
        "request_goodput": good / duration,
        "goodput_slo": slo.as_dict(),
    }
    result.update(_summary("ttft", [r.ttft for r in done], percentiles))
    result.update(_summary("tpot", [r.tpot for r in done if r.tpot is not None], percentiles))
    result.update(_summary("itl", [gap for r in done for gap in r.itls], percentiles))
    result.update(_summary("e2el", [r.e2el for r in done], percentiles))
    return result


ROWS = (
    ("completed", "completed", "{:.0f}"), ("failed (429 {rejected_429})", "failed", "{:.0f}"),
    ("request throughput (req/s)", "request_throughput", "{:.3f}"), ("goodput (req/s)", "request_goodput", "{:.3f}"),
    ("output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ("mean TTFT (ms)", "mean_ttft_ms", "{:.1f}"), ("median TTFT (ms)", "median_ttft_ms", "{:.1f}"),
    ("p99 TTFT (ms)", "p99_ttft_ms", "{:.1f}"), ("mean TPOT (ms)", "mean_tpot_ms", "{:.1f}"),
    ("p99 TPOT (ms)", "p99_tpot_ms", "{:.1f}"), ("mean ITL (ms)", "mean_itl_ms", "{:.1f}"),
    ("p99 ITL (ms)", "p99_itl_ms", "{:.1f}"), ("mean E2E (ms)", "mean_e2el_ms", "{:.1f}"),
    ("p99 E2E (ms)", "p99_e2el_ms", "{:.1f}"),
)


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'':30}" + "".join(f"{n:>24}" for n in names)]
    for label, key, fmt in ROWS:
        label = label.format(rejected_429="/".join(str(results[n]["rejected_429"]) for n in names))
        lines.append(f"{label:30}" + "".join(f"{fmt.format(results[n][key]):>24}" for n in names))
    return "\n".join(lines)


def plots(runs: dict[str, list[tuple[float, dict, list[RequestRecord]]]], out_dir: Path) -> list[str]:
    """Latency CDFs (TTFT, E2E) per run and goodput vs rate per mode; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'mmserve[bench]')", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, points in runs.items():
        for rate, _, records in points:
            done = [r for r in records if r.ok and r.output_tokens]
            for ax, values in ((axes[0], [r.ttft * 1000 for r in done]), (axes[1], [r.e2el * 1000 for r in done])):
                values = sorted(values)
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{mode} @{rate:.2f}/s")
        axes[2].plot([p[0] for p in points], [p[1]["request_goodput"] for p in points], marker="o", label=mode)
    for ax, title in zip(axes, ("TTFT CDF (ms)", "E2E latency CDF (ms)", "goodput (req/s) vs request rate")):
        ax.set_title(title)
        ax.legend()
    path = out_dir / "serve_bench.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [str(path)]
