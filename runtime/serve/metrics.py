"""Counters, gauges and histograms in the Prometheus text format (GET /metrics), thread-safe.

Small on purpose (prometheus_client would add a dependency for three metric kinds): every metric is
declared in ``Metrics.__init__``, labels are a fixed small set, values only grow (counters) or are set
(gauges); ``collectors`` add values read at scrape time (the audio devices' xrun counters).
"""
from __future__ import annotations

import math
import threading
from typing import Callable

# seconds: TTFT and stage latencies of a voice board live between 10 ms and a few seconds
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
RATE_BUCKETS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500)  # tokens per second


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, esc)) + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()):
        self.name, self.doc, self.label_names = name, doc, labels
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, doc, labels=()):
        super().__init__(name, doc, labels)
        self._v: dict[tuple, float] = {} if labels else {(): 0.0}

    def inc(self, n: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._v[labels] = self._v.get(labels, 0.0) + n

    def value(self, *labels: str) -> float:
        return self._v.get(labels, 0.0)

    def lines(self) -> list[str]:
        with self._lock:
            items = sorted(self._v.items())
        return self.header() + [f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, v: float, *labels: str) -> None:
        with self._lock:
            self._v[labels] = float(v)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, doc, labels=(), buckets=LATENCY_BUCKETS):
        super().__init__(name, doc, labels)
        self.buckets = tuple(sorted(buckets))
        self._v: dict[tuple, list] = {}  # labels -> [counts per bucket..., +Inf count, sum]

    def observe(self, v: float, *labels: str) -> None:
        if v is None or not math.isfinite(v):
            return
        with self._lock:
            row = self._v.setdefault(labels, [0] * (len(self.buckets) + 1) + [0.0])
            for i, b in enumerate(self.buckets):
                if v <= b:
                    row[i] += 1
            row[len(self.buckets)] += 1
            row[-1] += v

    def count(self, *labels: str) -> int:
        row = self._v.get(labels)
        return row[len(self.buckets)] if row else 0

    def lines(self) -> list[str]:
        out = self.header()
        with self._lock:
            items = sorted((k, list(r)) for k, r in self._v.items())
        for k, row in items:
            for i, b in enumerate((*self.buckets, math.inf)):
                lab = _labels((*self.label_names, "le"), (*k, _num(b)))
                out.append(f"{self.name}_bucket{lab} {row[i]}")
            out.append(f"{self.name}_sum{_labels(self.label_names, k)} {_num(row[-1])}")
            out.append(f"{self.name}_count{_labels(self.label_names, k)} {row[len(self.buckets)]}")
        return out


class Metrics:
    """Everything /metrics shows. ``source`` labels are "api", "wyoming" or "voice"."""

    def __init__(self):
        self.requests = Counter("boardtalk_requests_total", "HTTP API requests by path and status code",
                                ("path", "code"))
        self.turns = Counter("boardtalk_voice_turns_total", "voice turns answered")
        self.generations = Counter("boardtalk_generations_total", "LLM generations by source and finish reason",
                                   ("source", "finish"))
        self.cancellations = Counter("boardtalk_cancellations_total", "generations cancelled, by reason",
                                     ("reason",))
        self.tokens = Counter("boardtalk_generated_tokens_total", "tokens generated", ("source",))
        self.prompt_tokens = Counter("boardtalk_prompt_tokens_total", "prompt tokens computed (not reused)",
                                     ("source",))
        self.ttft = Histogram("boardtalk_ttft_seconds", "time to first token from request arrival (queue + prefill "
                              "+ first step) or, for voice, from the end of speech", ("source",))
        self.queue_wait = Histogram("boardtalk_queue_seconds", "time a request waited for the model", ("source",))
        self.stage = Histogram("boardtalk_voice_stage_seconds", "voice turn stage latencies", ("stage",))
        self.rate = Histogram("boardtalk_decode_tokens_per_second", "decode speed of each generation", ("source",),
                              buckets=RATE_BUCKETS)
        self.queue_depth = Gauge("boardtalk_queue_depth", "API requests waiting for the model")
        self.busy = Gauge("boardtalk_busy", "1 while a generation runs")
        self.ready = Gauge("boardtalk_ready", "1 once warm (model loaded, system prompt prefilled)")
        self.audio = Gauge("boardtalk_audio_events_total", "audio device counters (xruns, reconnects, ...)",
                           ("device", "event"))
        self.audio.kind = "counter"  # a snapshot of the devices' own counters, which only grow
        self.audio_up = Gauge("boardtalk_audio_connected", "1 while the audio device is open", ("device",))
        self.all: list[_Metric] = [v for v in vars(self).values() if isinstance(v, _Metric)]
        self.collectors: list[Callable[["Metrics"], None]] = []

    def render(self) -> str:
        for c in list(self.collectors):
            c(self)
        return "\n".join(line for m in self.all for line in m.lines()) + "\n"
