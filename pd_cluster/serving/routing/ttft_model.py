"""Conditional disaggregation: per request, is remote prefill (P, then ship the KV to D) or a
prefill on D alone expected to give the first token sooner?

(a) remote: P's queued prefill work and the prompt tokens P's cache lacks, at P's measured
    prefill rate, plus shipping the tokens D lacks over the link (measured latency + bytes at
    the measured bandwidth);
(b) local: D's queued prefill work and the tokens D's cache lacks, at D's measured rate (which
    includes the slowdown of prefilling between decode steps under max_prefill_tokens_per_step).
Each path's estimate is corrected by its measured bias (Bias: delivered minus estimated, learnt
from the requests that took the path): the formulas leave out the proxy's hops and each step's
fixed cost, and remote counts the link although the client's first token is P's.
Local wins only when it is cheaper by more than ``margin`` seconds plus ``stall`` seconds: the
delay a local prefill adds to the requests D is decoding (each waits out every local prefill
step; the planner weighs it, proxy.local_prefill_stall_weight). So an idle cluster
disaggregates as before, and D prefills when P's queue (or P's missing cache) costs the new
request more than D's running requests would lose.
Two targets (proxy.slo) bound that: the local prefill is a pause of D's decoding, allowed only
when it fits the TPOT slack of every request D runs (``slack``, tpot_budget.py): however late
the new request's first token would be, it never breaks another's TPOT; and when remote would
miss the TTFT target that local meets, the stall weight gives way (the pause fits the slack).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

REMOTE, LOCAL = "remote", "local"


@dataclass(frozen=True)
class Side:
    """One engine's part in the estimate (tokens and tokens/s)."""
    uncached_tokens: int  # prompt tokens this engine would compute
    backlog_tokens: int  # prefill work queued ahead of the request on it
    prefill_rate: float  # tokens/s, measured (or the default before any measurement)

    def seconds(self) -> float:
        return (self.backlog_tokens + self.uncached_tokens) / max(self.prefill_rate, 1e-9)


@dataclass(frozen=True)
class Link:
    ship_tokens: int  # prompt tokens whose KV D lacks (what P sends)
    bytes_per_token: float
    bandwidth: float  # bytes/s
    latency: float  # s: P's first token -> D running, beyond the bytes themselves

    def seconds(self) -> float:
        if self.ship_tokens <= 0:
            return self.latency
        return self.latency + self.ship_tokens * self.bytes_per_token / max(self.bandwidth, 1e-9)


@dataclass(frozen=True)
class Decision:
    path: str  # REMOTE or LOCAL
    # What decided (a Prometheus label: a short fixed vocabulary): remote_cheaper (remote's
    # estimate is no later), margin (local is sooner, but by less than the margin), stall
    # (local is sooner by more than the margin, but not by the margin plus the stall it adds to
    # D's running requests), tpot (local is sooner, but the pause it makes D take exceeds what
    # D's requests absorb within the TPOT target), local_cheaper (sooner by more than the
    # margin and the stall), local_ttft (remote misses the TTFT target that local meets, and
    # the pause fits the TPOT slack), always (no estimate).
    reason: str
    remote_s: float = 0.0  # the estimates (0 when not estimated)
    local_s: float = 0.0
    margin_s: float = 0.0
    stall_s: float = 0.0
    pause_s: float = 0.0  # D's prefill work, this prompt's included: the pause local makes
    slack_s: float = float("inf")  # the pause D's requests absorb within the TPOT target

    def describe(self) -> str:
        """For the access log: the path and what decided it, in words and figures."""
        if not (self.remote_s or self.local_s):
            return f"{self.path}({self.reason})"
        r, lo, m, st = (f"{x * 1e3:.1f}ms" for x in (self.remote_s, self.local_s, self.margin_s,
                                                      self.stall_s))
        why = {"remote_cheaper": f"remote={r} <= local={lo}",
               "margin": f"local={lo} sooner than remote={r} by less than the margin {m}",
               "stall": f"local={lo} sooner than remote={r} by less than the margin {m} plus "
                        f"the stall {st} it adds to D's running requests",
               "local_cheaper": f"local={lo} sooner than remote={r} by more than the "
                                f"margin {m}" + (f" plus the stall {st}" if self.stall_s else ""),
               "tpot": f"local={lo} sooner than remote={r}, but its {self.pause_s * 1e3:.1f}ms "
                       f"pause exceeds the {self.slack_s * 1e3:.1f}ms D's requests absorb "
                       f"within the TPOT target",
               "local_ttft": f"remote={r} misses the TTFT target, local={lo} meets it and "
                             f"its {self.pause_s * 1e3:.1f}ms pause fits D's TPOT slack "
                             f"{self.slack_s * 1e3:.1f}ms",
               }.get(self.reason, f"remote={r} local={lo}")
        return f"{self.path}({self.reason}: {why})"


class Bias:
    """Per path, the mean of (delivered - estimated) TTFT in s, exponentially weighted (plain:
    a bias may be negative, unlike the rates' Ewma). A path not taken for ``stale`` s counts
    as unbiased again: a bias learnt in a slow spell must not keep that path unchosen, and so
    unmeasured, for good."""

    def __init__(self, alpha: float = 0.1, stale: float = 2.0):
        self.alpha, self.stale = alpha, stale
        self.value = {REMOTE: 0.0, LOCAL: 0.0}
        self._updated = {REMOTE: 0.0, LOCAL: 0.0}

    def add(self, path: str, delivered: float, estimate: float) -> None:
        if self.get(path) == 0.0:
            self.value[path] = 0.0
        self.value[path] += self.alpha * (delivered - estimate - self.value[path])
        self._updated[path] = time.monotonic()

    def get(self, path: str) -> float:
        if time.monotonic() - self._updated[path] > self.stale:
            return 0.0
        return self.value[path]


def decide(prefill: Side, decode: Side, link: Link, margin: float = 0.0,
           bias: Bias | None = None, stall: float = 0.0, slack: float = float("inf"),
           ttft_target: float = float("inf")) -> Decision:
    """Remote unless D prefilling alone is expected to answer more than ``margin`` + ``stall``
    s sooner (``stall``: what the local prefill costs D's running requests, weighed) and its
    pause (D's whole prefill backlog) fits ``slack``, the TPOT slack of D's requests; the
    stall gives way when only local meets ``ttft_target``."""
    b = {path: bias.get(path) if bias is not None else 0.0 for path in (REMOTE, LOCAL)}
    remote = max(prefill.seconds() + link.seconds() + b[REMOTE], 0.0)
    local = max(decode.seconds() + b[LOCAL], 0.0)
    pause = decode.seconds()
    facts = dict(remote_s=remote, local_s=local, margin_s=margin, stall_s=stall, pause_s=pause,
                 slack_s=slack)
    if remote <= local:
        return Decision(REMOTE, "remote_cheaper", **facts)
    if local + margin >= remote:
        return Decision(REMOTE, "margin", **facts)
    if pause > slack:
        return Decision(REMOTE, "tpot", **facts)
    if local + margin + stall >= remote:
        if remote > ttft_target >= local:
            return Decision(LOCAL, "local_ttft", **facts)
        return Decision(REMOTE, "stall", **facts)
    return Decision(LOCAL, "local_cheaper", **facts)
