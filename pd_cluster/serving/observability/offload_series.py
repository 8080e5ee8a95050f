"""The engines' KV offloading stats (``kv_offload_*``: the host and disk tiers below each engine's
device pool, engine/kv_tiers/) on /metrics, labelled per engine and tier, and as one line per
engine in `pd-cluster status`.

An engine reports these stats only when it has a tier (engine.kv_offloading_size); an engine
without one exports none of these series. vLLM's names where its KV offloading exports the same
thing (its offloading connector: bytes and seconds loaded to / stored from the device, block
evictions, CPU-cache usage; its tiered offloading: block hits per tier), with a ``tier`` label
added where vLLM's series has none; ``pd_kv_offload_*`` for the rest. Read from each engine's
latest stats at scrape time, like engine_series.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "kv_offload_"  # the engine stats this module exports (and engine_series.py does not)
TIERS = ("host", "disk")


@dataclass(frozen=True)
class _TierSeries:
    stat: str  # the engine stat, ``{tier}`` standing for host / disk
    name: str  # the series
    help: str
    counter: bool = True


_PER_TIER = (
    _TierSeries("kv_offload_hit_blocks_{tier}", "vllm:kv_offload_tiering_block_hits",
                "Prompt KV blocks the engine's device cache lacked and this tier held (restored "
                "by a copy, counted as cached tokens)"),
    _TierSeries("kv_offload_bytes_restored_{tier}", "vllm:kv_offload_load_bytes",
                "KV bytes read out of this tier on restores: host, into device blocks (disk "
                "hits included: they pass through a host slot); disk, into host slots"),
    _TierSeries("kv_offload_bytes_saved_{tier}", "vllm:kv_offload_store_bytes",
                "KV bytes saved into this tier (blocks leaving the tier above it)"),
    _TierSeries("kv_offload_evicted_blocks_{tier}", "vllm:kv_offload_block_eviction",
                "KV blocks dropped from this tier to make room (least recently used first)"),
    _TierSeries("kv_offload_saved_blocks_{tier}", "pd_kv_offload_saved_blocks",
                "KV blocks saved into this tier"),
    _TierSeries("kv_offload_{tier}_blocks_used", "pd_kv_offload_blocks_used",
                "KV blocks this tier holds now", counter=False),
)


# Per engine, no tier: (stat, series, help, counter?)
_PER_ENGINE = (
    _TierSeries("kv_offload_restore_seconds", "vllm:kv_offload_load_time",
                "Seconds spent restoring KV blocks from the engine's lower tiers into its "
                "device blocks"),
    _TierSeries("kv_offload_host_blocks_total", "pd_kv_offload_host_blocks_total",
                "KV blocks the engine's host tier holds at most", counter=False),
    _TierSeries("kv_offload_disk_misses", "pd_kv_offload_disk_misses",
                "Disk-tier blocks found missing or corrupt when read back (a miss: the prompt "
                "is computed instead)"),
    _TierSeries("kv_offload_disk_write_errors", "pd_kv_offload_disk_write_errors",
                "Disk-tier writes that failed (full disk, directory gone): the block is not "
                "kept"),
    _TierSeries("kv_offload_disk_unsafe_files", "pd_kv_offload_disk_unsafe_files",
                "Disk-tier files skipped as not this user's alone (a symlink, another user's "
                "file, or one others may write): never indexed nor restored"),
)
_KNOWN = ({s.stat.format(tier=t) for s in _PER_TIER for t in TIERS}
          | {s.stat for s in _PER_ENGINE})


def _vllm(series: _TierSeries) -> bool:
    return series.name.startswith("vllm:")


class OffloadCollector(Collector):
    """The series above, for every engine whose latest stats carry ``kv_offload_*``; a
    ``kv_offload_*`` stat not in the tables yet is still exported, as ``pd_<stat>``."""

    def __init__(self, snapshot: Callable[[], list[Any]], model_name: str):
        self._snapshot, self._model = snapshot, model_name

    def collect(self) -> Iterable[Metric]:
        vllm_labels, pd_labels = ["model_name", "engine"], ["engine", "role"]
        fams: dict[str, Metric] = {}
        for s in (*_PER_TIER, *_PER_ENGINE):
            kind = CounterMetricFamily if s.counter else GaugeMetricFamily
            labels = (vllm_labels if _vllm(s) else pd_labels) + (["tier"] if "{tier}" in s.stat
                                                                  else [])
            fams[s.name] = kind(s.name, s.help, labels=labels)
        usage = GaugeMetricFamily(
            "vllm:kv_offload_cpu_cache_usage_perc", "Share of the engine's host KV tier in use "
            "(1 = all)", labels=vllm_labels)
        others: dict[str, Metric] = {}
        for e in self._snapshot():
            st = e.stats
            vl, pl = [self._model, e.name], [e.name, e.role]
            for s in _PER_TIER:
                for tier in TIERS:
                    value = st.get(s.stat.format(tier=tier))
                    if _number(value):
                        fams[s.name].add_metric((vl if _vllm(s) else pl) + [tier], float(value))
            for s in _PER_ENGINE:
                if _number(st.get(s.stat)):
                    fams[s.name].add_metric(vl if _vllm(s) else pl, float(st[s.stat]))
            total = st.get("kv_offload_host_blocks_total")
            if _number(total) and total:
                usage.add_metric(vl, float(st.get("kv_offload_host_blocks_used", 0)) / total)
            for key, value in st.items():
                if key.startswith(PREFIX) and key not in _KNOWN and _number(value):
                    fam = others.get(key)
                    if fam is None:
                        fam = others[key] = GaugeMetricFamily(
                            f"pd_{key}", f"Engine stat {key} (not described yet in "
                            f"serving/observability/offload_series.py)", labels=pd_labels)
                    fam.add_metric(pl, float(value))
        yield from fams.values()
        yield usage
        yield from others.values()


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def tier_line(stats: dict[str, Any]) -> str | None:
    """`pd-cluster status`'s line for an engine's KV tiers (None: it has none): host used/total,
    disk used (once its disk tier saved anything), hits and bytes restored per tier."""
    if "kv_offload_host_blocks_total" not in stats:
        return None

    def g(key: str) -> int:
        return int(stats.get(key) or 0)
    parts = [f"host {g('kv_offload_host_blocks_used')}/{g('kv_offload_host_blocks_total')} "
             f"blocks"]
    if g("kv_offload_disk_blocks_used") or g("kv_offload_saved_blocks_disk"):
        parts.append(f"disk {g('kv_offload_disk_blocks_used')} blocks")
    hits = ", ".join(f"{tier} {g(f'kv_offload_hit_blocks_{tier}')}" for tier in TIERS)
    restored = ", ".join(f"{tier} {_mib(g(f'kv_offload_bytes_restored_{tier}'))}"
                         for tier in TIERS)
    return f"{'; '.join(parts)}; hits (blocks): {hits}; restored: {restored}"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
