"""What each engine stat is called on /metrics, and what it means, in one table.

A stat that vLLM exports under its own name (running and waiting requests, KV cache usage,
preemptions, prefix-cache queries and hits) is exported once, under that name (vllm_metrics.py), and is absent here; the rest
are P/D's own, ``pd_engine_<stat>{engine, role}``. Running totals are counters (``_total``),
summed over engines by the reader (``sum(pd_engine_kv_bytes_sent_total)``), not by us.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pd_cluster.fault_sites import counter_name
from pd_cluster.faults import FAULT_KINDS, FAULT_SITES


@dataclass(frozen=True)
class EngineSeries:
    help: str
    counter: bool = False  # a running total (else a point-in-time value)


# Stats exported under vLLM's names instead (vllm_metrics.VLLMEngineCollector).
AS_VLLM = {"num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free", "num_preemptions",
           "prefix_cache_queried_blocks", "prefix_cache_hit_blocks", "spec_num_drafts",
           "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_accepted_per_pos"}
# Stats that are not numbers to plot (the ranks' pids, the CPU kernels' state in words: for
# `pd-cluster status`).
NOT_SERIES = {"tp_pids", "cpu_kernels", "kv_cache_dtype", "kv_pipe",
              "kv_links", "compile_state"}
# The connector's transfer stats (connectors/pd_connector.py): labelled with the KV pipe that
# carried them too (pipe="zmq", "nixl", ...), so a cluster's series split per pipe.
PIPE_SERIES = {"kv_bytes_sent", "kv_bytes_received", "kv_send_seconds", "kv_recv_seconds",
               "kv_send_timeouts", "kv_dropped_messages", "kv_digest_failures",
               "kv_refused_messages", "kv_auth_failures", "kv_integrity_failures",
               "kv_prefix_hit_tokens", "kv_bytes_skipped", "kv_draft_bytes_sent",
               "kv_draft_bytes_received"}

ENGINE_SERIES: dict[str, EngineSeries] = {
    "num_kv_fenced_blocks": EngineSeries(
        "KV blocks of ended receives kept out of use because a producer writing in place "
        "may still write into them (until its FIN, its connection's loss or a bound)"),
    "num_waiting_for_remote_kv": EngineSeries(
        "Requests on a decode engine waiting for their prompt's KV from a prefill engine "
        "(also counted in vllm:num_requests_waiting)"),
    "num_active": EngineSeries("Requests the engine holds now, from admission to their last "
                               "token"),
    "kv_blocks_total": EngineSeries("Blocks in the engine's KV cache (the share in use is "
                                    "vllm:kv_cache_usage_perc)"),
    "kv_bytes_per_token": EngineSeries(
        "Bytes of KV cache one token takes in the engine, all layers and ranks (an FP8 "
        "cache's per-block scales included): what it holds and ships per prompt token"),
    "tensor_parallel_size": EngineSeries("Devices (tensor-parallel ranks) the engine runs on"),
    "cpu_kernels_loaded": EngineSeries(
        "1 if the engine runs the C++ CPU kernels (paged attention, packed GEMM op); 0 if they "
        "are off (a GPU engine, PD_CLUSTER_CPU_KERNELS=0) or failed to build: then its "
        "attention is the slower torch reference (`pd-cluster status` says why)"),
    "compiled": EngineSeries(
        "1 once the engine's steps run the compiled model (engine.compile; in the background "
        "the engine serves eagerly until then), 0 while it compiles, if its compile failed or "
        "if compile is off (`pd-cluster status` says which)"),
    "kv_fallbacks": EngineSeries(
        "Requests a decode engine prefilled itself because their KV did not arrive within "
        "kv_transfer.kv_transfer_timeout", counter=True),
    "kv_bytes_sent": EngineSeries("Prompt KV bytes a prefill engine sent to decode engines",
                                  counter=True),
    "kv_bytes_received": EngineSeries(
        "Prompt KV bytes a decode engine received from prefill engines", counter=True),
    "kv_send_seconds": EngineSeries(
        "Seconds from a request's first KV layer sent to the decode engine's acknowledgement, "
        "summed over requests", counter=True),
    "kv_recv_seconds": EngineSeries("Seconds a decode engine spent receiving requests' KV, "
                                    "summed over requests", counter=True),
    "kv_send_timeouts": EngineSeries(
        "KV sends, or holds of sent blocks, that ran out before the decode engine confirmed",
        counter=True),
    "kv_dropped_messages": EngineSeries(
        "Malformed or unexpected KV transfer messages the engine dropped", counter=True),
    "kv_prefix_hit_tokens": EngineSeries(
        "Prompt tokens a decode engine already held in its prefix cache, so their KV was not "
        "shipped", counter=True),
    "kv_bytes_skipped": EngineSeries(
        "KV bytes not shipped because the decode engine already held them", counter=True),
    "kv_draft_bytes_sent": EngineSeries(
        "Of kv_bytes_sent: a speculative draft model's KV, shipped after the target's so the "
        "decode engine need not run the draft's prefill", counter=True),
    "kv_draft_bytes_received": EngineSeries(
        "Of kv_bytes_received: a speculative draft model's KV from prefill engines",
        counter=True),
    "spec_draft_prefill_tokens": EngineSeries(
        "Prompt tokens the engine ran through its speculative draft model itself (on a decode "
        "engine: requests whose draft KV did not come with their KV)", counter=True),
    "kv_auth_failures": EngineSeries(
        "KV peers refused: no valid proof of the cluster secret", counter=True),
    "kv_digest_failures": EngineSeries(
        "KV transfers failed closed (a message that failed its integrity check, a missing "
        "layer, blocks the request does not own): the decode engine recomputed", counter=True),
    "kv_integrity_failures": EngineSeries(
        "KV messages dropped because their MAC or CRC-32 (kv_transfer.integrity) did not hold, "
        "or their number was replayed or out of order", counter=True),
    "kv_refused_messages": EngineSeries(
        "KV messages refused by a per-peer bound (unknown request, oversized frame, staging "
        "held by one peer) or from a peer without a handshake", counter=True),
    "grammar_failures": EngineSeries(
        "Requests ended with an error because their grammar broke mid-request (a refused "
        "token or a backend error) rather than go on unconstrained", counter=True),
    "lend_borrowed_steps": EngineSeries(
        "Steps run with another engine's lent core: a prefill engine's prefill steps on a "
        "decode engine's, a decode engine's decode steps on an idle prefill engine's "
        "(driver/core_lending.py)", counter=True),
    "lend_borrowed_seconds": EngineSeries("Seconds of steps on lent cores", counter=True),
    "lend_refused_steps": EngineSeries(
        "Steps run at home because the other engine could not spare its cores for them (the "
        "decode engine's TPOT slack too small, or the prefill engine has a prompt to compute)",
        counter=True),
    "lend_pauses": EngineSeries(
        "Times this engine paused for a step of another engine on its lent cores",
        counter=True),
    "lend_pause_seconds": EngineSeries(
        "Seconds this engine paused for steps of another engine on its lent cores",
        counter=True),
    "lend_revokes": EngineSeries(
        "Borrows of this engine's cores it ended early (new work beyond what it could spare, "
        "or an overrun): it moved the borrowed thread back at once", counter=True),
    "session_auth_failures": EngineSeries(
        "Proxy session connections refused: no valid proof of the cluster secret",
        counter=True),
    "requests_total": EngineSeries("Requests the engine accepted", counter=True),
    "requests_finished": EngineSeries("Requests the engine finished", counter=True),
    "requests_rejected": EngineSeries("Requests the engine rejected as invalid", counter=True),
    "calls_dropped": EngineSeries(
        "Control calls dropped unrun: their caller had given up waiting", counter=True),
    "tokens_generated": EngineSeries(
        "Tokens the engine generated (a prefill engine's first tokens included)", counter=True),
    "steps": EngineSeries("Engine steps (one batch through the model)", counter=True),
    "step_seconds": EngineSeries("Seconds spent in engine steps", counter=True),
    "output_steps": EngineSeries("Engine steps that produced tokens", counter=True),
    "output_step_seconds": EngineSeries("Seconds spent in engine steps that produced tokens",
                                        counter=True),
    "output_messages": EngineSeries(
        "Token messages (one per engine step) the engine sent to proxies", counter=True),
    "output_sessions_dropped": EngineSeries(
        "Proxy token sessions the engine closed (the proxy left, or stopped reading)",
        counter=True),
    "session_requests": EngineSeries("Requests the engine read from proxies' request sockets",
                                     counter=True),
    "session_aborts": EngineSeries("Aborts the engine read from proxies' request sockets",
                                   counter=True),
    "session_malformed": EngineSeries(
        "Malformed messages on the engine's request sockets, dropped", counter=True),
}
# Test-only fault injection (engine.faults, pd_cluster/faults.py): what was injected where.
_SITE_WORDS = {"kv_send": "KV pipe sends", "kv_recv": "KV pipe receives",
               "token": "token path frames", "control": "control calls"}
ENGINE_SERIES.update({
    counter_name(site, kind): EngineSeries(
        f"Test-only engine.faults: {_SITE_WORDS[site]} hit by an injected {kind} fault",
        counter=True)
    for site in FAULT_SITES for kind in FAULT_KINDS})


def series_name(stat: str) -> str:
    return "pd_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", stat)


def describe(stat: str) -> EngineSeries:
    """The stat's series; a stat not in the table yet is still exported, as a gauge."""
    return ENGINE_SERIES.get(stat) or EngineSeries(
        f"Engine stat {stat} (not described yet in serving/observability/engine_series.py)")


def kv_link_line(engine: dict[str, Any], engines: list[dict[str, Any]]) -> str | None:
    """`pd-cluster status`: a prefill engine's KV links and the pipe each uses
    ("decode-0 via zmq, decode-1 via shm"); None for an engine with none."""
    links = engine.get("stats", {}).get("kv_links") or {}
    if not isinstance(links, dict) or not links:
        return None
    names = {e.get("kv_endpoint"): e["name"] for e in engines if e.get("kv_endpoint")}
    return ", ".join(f"{names.get(ep, ep)} via {pipe}" for ep, pipe in sorted(
        links.items(), key=lambda kv: names.get(kv[0], kv[0])))
