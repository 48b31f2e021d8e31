"""Prometheus text exposition of an engine's state and of per-request latencies."""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, count in zip(self.buckets + (float("inf"),), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {running}"]
        return lines


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.ttft = Histogram("loom_time_to_first_token_seconds", "Launch to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("loom_time_per_output_token_seconds", "Mean gap between a request's tokens.",
                              TPOT_BUCKETS)

    def observe(self, handle) -> None:
        """Record a finished request's latencies from its delivery times."""
        times = handle.token_times
        with self.lock:
            if times:
                self.ttft.observe(times[0] - handle.launch_time)
            if len(times) > 1:
                self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def render(self) -> str:
        s = self.engine.stats()
        gauges = [
            ("loom_requests_running", "gauge", "Requests in the running batch.", s["running"]),
            ("loom_requests_waiting", "gauge", "Requests waiting for admission.", s["waiting"]),
            ("loom_kv_blocks_used", "gauge", "KV cache blocks held by requests.", s["total_kv_blocks"] - s["free_kv_blocks"]),
            ("loom_kv_blocks_free", "gauge", "KV cache blocks free (including unheld cached prefixes).", s["free_kv_blocks"]),
            ("loom_tokens_generated_total", "counter", "Tokens generated.", s["tokens_generated"]),
            ("loom_requests_finished_total", "counter", "Requests finished.", s["requests_finished"]),
            ("loom_preemptions_total", "counter", "Requests preempted (recomputed later).", s["preemptions"]),
            ("loom_speculative_proposed_tokens_total", "counter", "Tokens proposed by speculative decoding.",
             s["speculative_proposed_tokens"]),
            ("loom_speculative_accepted_tokens_total", "counter",
             "Proposed tokens accepted (each a token gained without a step of its own).",
             s["speculative_accepted_tokens"]),
            ("loom_draft_forwards_total", "counter", "Batched forwards of the draft model (--draft).",
             s["draft_forwards"]),
            ("loom_draft_seconds_total", "counter", "Seconds spent in the draft model's forwards.", s["draft_seconds"]),
            ("loom_draft_kv_blocks_used", "gauge", "The draft model's KV cache blocks held by requests.",
             s["total_draft_kv_blocks"] - s["free_draft_kv_blocks"]),
            ("loom_prefix_cache_hit_rate", "gauge", "Share of prompt tokens served from the prefix cache.",
             s["prefix_cache_hit_rate"]),
        ]
        lines = []
        for name, kind, help, value in gauges:
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
        with self.lock:
            lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"
