"""A soak of `hgc serve`: a mixed load for a fixed time, then what must hold after it.

Used by tests/server/test_soak.py (about a minute, in CI) and benchmarks/serving/soak.py (N
minutes, numbers printed).

1. `pool_counts(url)` reads /metrics: open requests, queue, state slots, KV pages and snapshots
   (free and total).
2. `run_soak(url, pid, seconds, clients, seed)` runs `clients` threads for `seconds`, each
   sending requests drawn from `MIX` (streamed and not, n > 1, stop strings, logprobs, structured
   output, chat, clients that leave mid-stream), more at once than the server has slots; beside
   them one thread polls /health and one samples the server's resident memory.
3. `SoakResult.problems()` lists what went wrong: a status other than 200, 4xx or 503 (a 500 above
   all), a pool not back to its size, memory after warm-up grown by more than `RSS_GROWTH`,
   /health slower than `HEALTH_BOUND`.

It does not start the server (the caller does, with testkit/helpers.ServerProcess).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import re
import threading
import time
from pathlib import Path

import httpx

__all__ = ["SoakResult", "run_soak", "pool_counts", "rss_bytes", "MIX", "RSS_GROWTH", "HEALTH_BOUND"]

RSS_GROWTH = 0.05  # resident memory after warm-up may grow by at most 5%
HEALTH_BOUND = 2.0  # seconds: the slowest /health answer allowed (a loaded 2-core CI machine)
WARM_UP = 0.3  # the share of the run before memory counts as warmed up


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` and every process below it (Linux /proc): `hgc serve`'s
    engine core is a child of the server process, and its memory is most of the server's."""
    return sum(_own_rss(p) for p in [pid, *_descendants(pid)])


def _own_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:  # a child that ended between the listing and the read
        return 0
    raise RuntimeError(f"process {pid}: no VmRSS in /proc/{pid}/status")


def _descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
        except (FileNotFoundError, ProcessLookupError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def pool_counts(url: str) -> dict[str, float]:
    """The pools' numbers from /metrics (gauges without labels)."""
    wanted = ("open_requests", "queue_depth", "running_requests", "state_slots_free", "state_slots", "kv_pages_free",
              "kv_pages", "prefix_cache_snapshots", "prefix_cache_snapshot_slots", "prefix_cache_snapshot_slots_free")
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for name in wanted:
        match = re.search(rf"^hgc_{name} (\S+)$", text, re.MULTILINE)
        out[name] = float(match.group(1)) if match else None
    return out


def _completion(rng, model):
    body = {"model": model, "prompt": [rng.randrange(1, 200) for _ in range(rng.randrange(2, 40))],
            "max_tokens": rng.randrange(1, 12), "temperature": rng.choice([0, 0.8])}
    return "/v1/completions", body


def _prompt_text(rng, model):
    return "/v1/completions", {"model": model, "prompt": "the quick brown fox " * rng.randrange(1, 6),
                               "max_tokens": 8, "stop": ["a", "e "], "temperature": 0.7, "seed": rng.randrange(100)}


def _n_logprobs(rng, model):
    path, body = _completion(rng, model)
    return path, {**body, "n": rng.randrange(2, 4), "logprobs": 2, "echo": rng.random() < 0.3}


def _chat(rng, model):
    return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hello " * 3}],
                                    "max_tokens": 6, "logprobs": True, "top_logprobs": 1}


def _structured(rng, model):
    return "/v1/completions", {"model": model, "prompt": "json:", "max_tokens": 10,
                               "response_format": {"type": "json_object"}}


# (name, weight, request maker, streamed, leaves after the first chunk)
MIX = [
    ("completion", 4, _completion, False, False),
    ("completion_stream", 3, _completion, True, False),
    ("text_stop", 2, _prompt_text, True, False),
    ("n_logprobs", 2, _n_logprobs, False, False),
    ("chat", 2, _chat, False, False),
    ("chat_stream", 1, _chat, True, False),
    ("structured", 1, _structured, False, False),
    ("disconnect", 2, _completion, True, True),
]


@dataclasses.dataclass
class SoakResult:
    seconds: float
    requests: collections.Counter  # kind -> count
    statuses: collections.Counter  # status -> count (0: a connection that failed)
    failures: list  # (kind, status, first 200 characters of the body)
    pools_before: dict
    pools_after: dict
    rss: list  # (seconds since start, bytes)
    health: list  # seconds of each /health answer

    def rss_growth(self) -> float:
        """Resident memory at the end over the largest sample of the warm-up, minus 1."""
        warm = [b for t, b in self.rss if t <= self.seconds * WARM_UP] or [self.rss[0][1]]
        return self.rss[-1][1] / max(warm) - 1

    def problems(self) -> list[str]:
        out = []
        bad = {s: c for s, c in self.statuses.items() if not (s == 200 or 400 <= s < 500 or s == 503)}
        if bad:
            out.append(f"statuses other than 200, 4xx and 503: {bad}; first: {self.failures[:3]}")
        after = self.pools_after
        for busy in ("open_requests", "queue_depth", "running_requests"):
            if after[busy]:
                out.append(f"{busy} is {after[busy]:g} after the load")
        if after["state_slots_free"] != after["state_slots"]:
            out.append(f"state slots: {after['state_slots_free']:g} of {after['state_slots']:g} free")
        if after["kv_pages_free"] != after["kv_pages"]:
            out.append(f"KV pages: {after['kv_pages_free']:g} of {after['kv_pages']:g} free")
        held = (after["prefix_cache_snapshot_slots"] or 0) - (after["prefix_cache_snapshot_slots_free"] or 0)
        if held != (after["prefix_cache_snapshots"] or 0):
            out.append(f"snapshots: {held:g} slots taken, the prefix cache holds {after['prefix_cache_snapshots']:g}")
        if self.rss_growth() > RSS_GROWTH:
            out.append(f"resident memory grew {self.rss_growth():.1%} after warm-up (bound {RSS_GROWTH:.0%})")
        if self.health and max(self.health) > HEALTH_BOUND:
            out.append(f"/health took {max(self.health):.2f} s (bound {HEALTH_BOUND} s)")
        return out

    def summary(self) -> dict:
        health = sorted(self.health)
        return {"seconds": round(self.seconds, 1), "requests": sum(self.requests.values()),
                "by_kind": dict(self.requests), "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "pools_before": self.pools_before, "pools_after": self.pools_after,
                "rss_mib": [(round(t), round(b / 2 ** 20, 1)) for t, b in self.rss],
                "rss_growth_after_warm_up": round(self.rss_growth(), 4),
                "health_ms": {"count": len(health), "median": round(health[len(health) // 2] * 1e3, 1),
                              "max": round(health[-1] * 1e3, 1)} if health else None,
                "problems": self.problems()}


def _send(client: httpx.Client, path: str, body: dict, stream: bool, leave: bool) -> tuple[int, str]:
    if not stream:
        r = client.post(path, json=body)
        return r.status_code, r.text
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(errors="replace")
        for line in r.iter_lines():
            if leave and line.startswith("data: {"):
                return 200, ""  # the client goes away mid-stream: the server must cancel its request
            if line.startswith("data: {") and '"error"' in line and json.loads(line[6:]).get("error"):
                return 500, line  # an error event after the status line
    return 200, ""


def run_soak(url: str, pid: int, seconds: float, clients: int, model: str, seed: int = 0,
             sample_every: float = 1.0) -> SoakResult:
    """Step 2 of the module docstring; every thread stops at `seconds`, then the pools are read."""
    deadline = time.monotonic() + seconds
    start = time.monotonic()
    lock = threading.Lock()
    requests, statuses, failures, rss, health = collections.Counter(), collections.Counter(), [], [], []
    pools_before = pool_counts(url)
    kinds = [k for k in MIX for _ in range(k[1])]

    def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        with httpx.Client(base_url=url, timeout=120) as client:
            while time.monotonic() < deadline:
                name, _, make, stream, leave = rng.choice(kinds)
                path, body = make(rng, model)
                try:
                    status, text = _send(client, path, body, stream, leave)
                except httpx.HTTPError as e:
                    status, text = 0, repr(e)
                with lock:
                    requests[name] += 1
                    statuses[status] += 1
                    if not (status == 200 or 400 <= status < 500 or status == 503):
                        failures.append((name, status, text[:200]))

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            next_rss = 0.0
            while time.monotonic() < deadline:
                began = time.perf_counter()
                client.get("/health")
                health.append(time.perf_counter() - began)
                now = time.monotonic() - start
                if now >= next_rss:
                    rss.append((now, rss_bytes(pid)))
                    next_rss = now + sample_every
                time.sleep(0.1)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=watch))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.5)  # cancellations of the clients that left are off the event loop: let them land
    rss.append((time.monotonic() - start, rss_bytes(pid)))
    return SoakResult(seconds, requests, statuses, failures, pools_before, pool_counts(url), rss, health)
