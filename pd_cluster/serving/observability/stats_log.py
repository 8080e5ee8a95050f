"""A periodic one-line summary per engine in the proxy's log, like vLLM's engine stats line:
queue depths, KV cache usage, prefix-cache hit rate and KV transfer and token rates. Only
while there is work: an engine with nothing running or waiting and no tokens or KV moved since
its last line (or an unhealthy one: always said) is left out, so an idle server's log is quiet."""
from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("pd_cluster.stats")

_RATES = (("tokens_generated", "tokens/s", 1.0), ("kv_bytes_sent", "KV sent MB/s", 1e-6),
          ("kv_bytes_received", "KV received MB/s", 1e-6))


class StatsLog:
    def __init__(self, interval: float):
        self.interval = interval
        self._last_time = time.monotonic()
        self._last: dict[str, dict[str, Any]] = {}

    def maybe_log(self, engines: list[Any]) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last_time < self.interval:
            return
        dt, self._last_time = now - self._last_time, now
        for e in engines:
            if self.busy(e):
                logger.info("%s", self.line(e, dt))
            self._last[e.name] = dict(e.stats)

    def busy(self, e: Any) -> bool:
        """Work to report: requests in the engine, or tokens or KV moved since its last line."""
        s, before = e.stats, self._last.get(e.name)
        if not e.healthy or s.get("num_running") or s.get("num_waiting") or s.get(
                "num_waiting_for_remote_kv"):
            return True
        moved = [k for k, _, _ in _RATES] + ["prefix_cache_queried_blocks"]
        return before is None and any(s.get(k) for k in moved) or before is not None and any(
            s.get(k, 0) != before.get(k, 0) for k in moved)

    def line(self, e: Any, dt: float) -> str:
        s, before = e.stats, self._last.get(e.name, {})
        if not e.healthy:
            return f"{e.name} ({e.role}, {e.node_ip or '?'}): UNHEALTHY {e.last_error or ''}"
        parts = [f"running {s.get('num_running', 0)}", f"waiting {s.get('num_waiting', 0)}"]
        if s.get("num_waiting_for_remote_kv"):
            parts.append(f"awaiting KV {s['num_waiting_for_remote_kv']}")
        if s.get("kv_blocks_total"):
            parts.append(f"KV {100.0 * s.get('kv_blocks_used', 0) / s['kv_blocks_total']:.1f}% used")
        queried = s.get("prefix_cache_queried_blocks", 0) - before.get(
            "prefix_cache_queried_blocks", 0)
        if queried > 0:
            hits = s.get("prefix_cache_hit_blocks", 0) - before.get("prefix_cache_hit_blocks", 0)
            parts.append(f"prefix hit {100.0 * hits / queried:.1f}%")
        drafted = s.get("spec_num_draft_tokens", 0) - before.get("spec_num_draft_tokens", 0)
        if drafted > 0:  # as vLLM's SpecDecoding line: acceptance rate and length
            accepted = s["spec_num_accepted_tokens"] - before.get("spec_num_accepted_tokens", 0)
            drafts = s["spec_num_drafts"] - before.get("spec_num_drafts", 0)
            parts.append(f"spec acceptance {100.0 * accepted / drafted:.1f}% "
                         f"(length {1 + accepted / max(drafts, 1):.2f})")
        for key, label, scale in _RATES:
            if key in s and key in before:
                rate = (s[key] - before[key]) * scale / dt
                if rate > 0:
                    parts.append(f"{label} {rate:.1f}")
        return f"{e.name} ({e.role}, {e.node_ip or '?'}): " + ", ".join(parts)
