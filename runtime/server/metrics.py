"""GET /metrics: the engine's and the server's numbers in the Prometheus text format (version 0.0.4).

`render_metrics(engine_stats, server)` writes one family per number: `# HELP`, `# TYPE`, then its
samples. Counters end in `_total`; label values are escaped. The numbers come from
`Engine.stats()` (queue, running, slots, pages, tokens, steps, preemptions, phase times, the
prefix cache's lookups, hits and snapshot memory, speculative decoding's drafts, acceptance and
draft time, kernels built after start-up) and from the server's own counters (requests by
endpoint and finish reason, errors by status, prompt tokens, time to first token).

Graph replays versus eager steps: the CPU runtime captures no CUDA graphs, so every step is eager
and `hgc_engine_steps_total{execution="graph_replay"}` is 0. A graph runner's counters
(`graph_replays`, `piecewise_steps`, `eager_steps`, as runtime/graphs/runner.py keeps them), merged
into the stats by the app (ServedModel.counters), show here without a change.

Example::

    # HELP hgc_queue_depth Requests waiting to be admitted to the batch.
    # TYPE hgc_queue_depth gauge
    hgc_queue_depth 0

It does not keep state (the app owns its counters) nor import a metrics library: the format is
five rules, and the tests parse the output with prometheus_client's parser.
"""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["MetricsText", "render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


class MetricsText:
    """Builds the exposition text one family at a time."""

    def __init__(self, prefix: str = "hgc_"):
        self.prefix = prefix
        self._lines: list[str] = []

    def add(self, name: str, kind: str, help: str, samples) -> None:
        """samples: a number, or an iterable of (labels dict, number); None values are left out."""
        assert kind in ("counter", "gauge", "summary"), kind
        name = self.prefix + name
        if kind == "counter":
            assert name.endswith("_total"), f"counter {name} must end in _total"
        if not isinstance(samples, Iterable):
            samples = [({}, samples)]
        self._lines.append(f"# HELP {name} {help}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            label_text = ",".join(f'{key}="{_escape(str(val))}"' for key, val in labels.items())
            self._lines.append(f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}")

    def add_summary(self, name: str, help: str, total: float, count: int) -> None:
        """A summary without quantiles: its _sum and _count (a rate of each gives the mean)."""
        name = self.prefix + name
        self._lines += [f"# HELP {name} {help}", f"# TYPE {name} summary",
                        f"{name}_sum {_number(float(total))}", f"{name}_count {_number(int(count))}"]

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _recent_tokens_per_second(recent_steps: list[dict]) -> float:
    """Tokens sampled per second of step time over the engine's recent steps (0 when idle so far)."""
    seconds = sum(step["seconds"] for step in recent_steps)
    return sum(step["sampled"] for step in recent_steps) / seconds if seconds > 0 else 0.0


def _prefix_cache(m: MetricsText, engine: dict) -> None:
    """The prefix cache's numbers (all 0 when the engine runs without one)."""
    get = lambda key: engine.get(f"prefix_cache_{key}", 0)  # noqa: E731
    m.add("prefix_cache_enabled", "gauge", "1 when the engine reuses cached prefixes.",
          bool(engine.get("prefix_cache")))
    m.add("prefix_cache_queries_total", "counter", "Tokens of admitted requests looked up in the prefix cache.",
          get("lookup_tokens"))
    m.add("prefix_cache_hits_total", "counter", "Tokens admitted requests found in the prefix cache (not prefilled).",
          get("hit_tokens"))
    m.add("prefix_cache_hit_rate", "gauge", "Cached tokens / looked-up tokens, over all admissions so far.",
          get("hit_tokens") / get("lookup_tokens") if get("lookup_tokens") else 0.0)
    m.add("prefix_cache_requests_total", "counter", "Admissions that looked up the prefix cache, by outcome.",
          [({"outcome": "hit"}, get("hits")), ({"outcome": "miss"}, get("lookups") - get("hits"))])
    m.add("prefix_cache_pages", "gauge", "KV pages the prefix cache holds (shared with running requests or not).",
          get("pages"))
    m.add("prefix_cache_snapshots", "gauge", "Linear-state snapshots the prefix cache holds.", get("snapshots"))
    m.add("prefix_cache_snapshot_slots", "gauge", "Snapshots the snapshot pool has room for.", get("snapshot_slots"))
    m.add("prefix_cache_snapshot_slots_free", "gauge",
          "Free snapshot-pool slots: slots minus free is what the cache and running requests hold.",
          get("snapshot_slots_free"))
    m.add("prefix_cache_snapshot_bytes", "gauge", "Bytes of the snapshot pool.", get("snapshot_bytes"))
    m.add("prefix_cache_snapshots_taken_total", "counter", "Snapshots taken of running requests.",
          get("snapshots_taken"))


def _speculative(m: MetricsText, engine: dict) -> None:
    """Speculative decoding's numbers (all 0 when the engine runs without it)."""
    get = lambda key: engine.get(f"spec_{key}") or 0  # noqa: E731
    m.add("spec_draft_tokens", "gauge", "Draft tokens verified per decoding request and step (0: no speculation).",
          get("draft_tokens"))
    m.add("spec_verify_steps_total", "counter", "Target-verify steps run.", get("verify_steps"))
    m.add("spec_draft_tokens_total", "counter", "Draft tokens proposed, by outcome.",
          [({"outcome": "accepted"}, get("accepted")), ({"outcome": "rejected"}, get("drafted") - get("accepted"))])
    m.add("spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens, over all verify steps so far.",
          float(get("acceptance_rate")))
    m.add("spec_accepted_tokens_per_step", "gauge",
          "Tokens a request gains per verify step (accepted drafts + the target's own), mean so far.",
          float(get("tokens_per_verify")))
    m.add("spec_draft_seconds_total", "counter", "Seconds spent running the draft program.", float(get("draft_s")))
    m.add("spec_verify_seconds_total", "counter", "Seconds spent in target-verify steps and acceptance.",
          float(get("verify_s")))


def render_metrics(engine: dict, server: dict) -> str:
    """engine: Engine.stats(); server: the app's counters (see ServerState.metrics_snapshot)."""
    m = MetricsText()
    m.add("queue_depth", "gauge", "Requests waiting to be admitted to the batch.", engine["queue_depth"])
    m.add("running_requests", "gauge", "Requests admitted to the batch (prefilling or decoding).", engine["running"])
    m.add("open_requests", "gauge", "HTTP requests the server is generating for.", server["open_requests"])
    m.add("state_slots_free", "gauge", "Free state-pool slots (linear-attention state).", engine["free_slots"])
    m.add("state_slots", "gauge", "State-pool slots a request can hold.", engine["total_slots"])
    m.add("kv_pages_free", "gauge", "Free KV-cache pages (full-attention layers).", engine["free_pages"])
    m.add("kv_pages", "gauge", "KV-cache pages in the pool.", engine["total_pages"])
    m.add("generation_tokens_per_second", "gauge",
          "Tokens sampled per second of step time over the engine's recent steps.",
          _recent_tokens_per_second(engine.get("recent_steps", [])))

    replays = int(engine.get("graph_replays", 0))
    piecewise = int(engine.get("piecewise_steps", 0))
    eager = int(engine.get("eager_steps", engine["steps"] - replays - piecewise))
    m.add("engine_steps_total", "counter",
          "Engine steps by how they ran: one CUDA graph replay, piecewise graphs with eager gaps, or eager.",
          [({"execution": "graph_replay"}, replays), ({"execution": "piecewise"}, piecewise),
           ({"execution": "eager"}, eager)])
    m.add("engine_phase_steps_total", "counter", "Engine steps by phase (a step with prompt tokens is prefill).",
          [({"phase": "prefill"}, engine["prefill_steps"]), ({"phase": "decode"}, engine["decode_steps"])])
    m.add("engine_schedule_steps_total", "counter",
          "Engine steps by schedule: ids read after the next step was launched (overlapped) or at once.",
          [({"schedule": "overlapped"}, engine["overlapped_steps"]),
           ({"schedule": "synchronous"}, engine["synchronous_steps"])])
    m.add("engine_phase_seconds_total", "counter", "Seconds spent in engine steps, by phase.",
          [({"phase": "prefill"}, float(engine["prefill_s"])), ({"phase": "decode"}, float(engine["decode_s"]))])
    m.add("generation_tokens_total", "counter", "Tokens sampled by the engine.", engine["tokens_generated"])
    m.add("prefill_tokens_total", "counter", "Prompt tokens run through the model (re-prefills included).",
          engine["prefill_tokens"])
    m.add("preemptions_total", "counter", "Requests preempted to free pages (they re-prefill later).",
          engine["preemptions"])
    m.add("kernels_built_serving_total", "counter",
          "Triton kernels built after start-up: variants the compiled bundle lacks (None: no bundle on the GPU).",
          engine.get("kernels_built_serving"))
    _prefix_cache(m, engine)
    _speculative(m, engine)

    m.add("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", server["prompt_tokens"])
    m.add("requests_total", "counter", "Accepted generation requests, by endpoint.",
          [({"endpoint": k}, v) for k, v in sorted(server["requests"].items())])
    m.add("requests_finished_total", "counter",
          "Finished generation requests by reason (cancelled: the client left; abort: the server stopped it; "
          "error: the engine failed).",
          [({"reason": k}, v) for k, v in sorted(server["finished"].items())])
    m.add("request_errors_total", "counter", "Refused or failed HTTP requests, by status code.",
          [({"status": str(k)}, v) for k, v in sorted(server["errors"].items())])
    m.add_summary("time_to_first_token_seconds", "Seconds from submit to a request's first token.",
                  server["ttft_sum"], server["ttft_count"])
    m.add_summary("request_duration_seconds", "Seconds from submit to a request's end.",
                  server["duration_sum"], server["duration_count"])
    m.add("server_cpu_seconds_total", "counter",
          "CPU seconds of the API server's process (HTTP, text, SSE; the engine too with --engine-in-process).",
          server.get("cpu_s"))
    m.add("engine_core_cpu_seconds_total", "counter",
          "CPU seconds of the engine core's process (None: the engine runs in the server's process).",
          engine.get("core_cpu_s"))
    m.add("engine_healthy", "gauge", "1 while the engine loop runs without error.", server["healthy"])
    m.add("server_draining", "gauge", "1 once shutdown has begun (no new requests).", server["draining"])
    return m.text()
