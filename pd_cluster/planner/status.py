"""The plan in force, for `pd-cluster status`: the proxy puts ``controller_status`` in its
/cluster/status reply (``planner``), the CLI prints it with ``status_lines``. JSON types only:
the reply crosses HTTP, and a proxy of another version may answer."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module without numpy or the controller
    from pd_cluster.planner.controller import Controller

OFF = {"enabled": False}


def controller_status(ctl: "Controller", now: float) -> dict[str, Any]:
    """The controller's state at ``now`` (its observations' clock); read from another thread
    than the controller's: plain attribute reads, each consistent on its own."""
    cfg, slo, st, last = ctl.config, ctl.slo, ctl.state, ctl.last
    engines: dict[str, dict[str, int]] = {}
    for v in ctl.actuator.engines():
        by_state = engines.setdefault(v.role, {})
        by_state[v.state] = by_state.get(v.state, 0) + 1
    changing = any(s != "serving" for states in engines.values() for s in states)
    if changing:
        next_action = "after the change under way"
    elif ctl.last_action_at + cfg.cooldown_s > now:
        next_action = "cooldown"
    else:
        next_action = "next look"
    return {
        "enabled": True,
        "engines": engines,
        "targets": {"ttft_ms": slo.ttft_s * 1e3, "tpot_ms": slo.tpot_s * 1e3,
                    "percentile": slo.percentile, "min_prefill": cfg.min_prefill,
                    "max_prefill": cfg.max_prefill, "min_decode": cfg.min_decode,
                    "max_decode": cfg.max_decode, "max_engines": cfg.engine_budget,
                    "interval_s": cfg.interval_s, "cooldown_s": cfg.cooldown_s,
                    "hysteresis": cfg.hysteresis},
        "measured": {"rate": st.rate, "prefill_capacity": st.prefill_capacity,
                     "decode_capacity": st.decode_capacity,
                     "ttft_ms": _ms(st.measured_ttft), "tpot_ms": _ms(st.measured_tpot)},
        "last": None if last is None else {
            "action": last.action, "role": last.role, "count": last.count,
            "reason": last.reason, "detail": last.detail, "engines": list(last.engine_ids),
            "ago_s": max(0.0, now - last.at)},
        "decisions": st.decisions,
        "pending": None if ctl.pending is None else " ".join(ctl.pending),
        "next_action": next_action,
        # the earliest a change can come: the cooldown's end, or the next look after it
        "next_action_in_s": max(0.0, ctl.last_action_at + cfg.cooldown_s - now,
                                _next_look(ctl.looked_at, cfg.interval_s, now)),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _next_look(looked_at: float | None, interval_s: float, now: float) -> float:
    return 0.0 if looked_at is None else max(0.0, looked_at + interval_s - now)


def status_lines(planner: dict[str, Any] | None) -> list[str]:
    """What `pd-cluster status` prints for the reply's ``planner`` (None: a proxy that does
    not report one: nothing)."""
    if planner is None:
        return []
    if not planner.get("enabled"):
        return ["planner: off (planner.enabled: false); the engines stay as scaled"]
    t, m = planner["targets"], planner["measured"]
    roles = []
    for role, states in sorted(planner["engines"].items()):
        moving = ", ".join(f"{n} {s}" for s, n in sorted(states.items()) if s != "serving")
        roles.append(f"{states.get('serving', 0)} {role}" + (f" ({moving})" if moving else ""))
    out = [f"planner: on, every {t['interval_s']:g}s, cooldown {t['cooldown_s']:g}s, "
           f"hysteresis {t['hysteresis']:g}; engines serving: {', '.join(roles) or 'none'}",
           f"planner targets: TTFT {t['ttft_ms']:g} ms, TPOT {t['tpot_ms']:g} ms at "
           f"p{t['percentile']:g}; prefill {t['min_prefill']}-{t['max_prefill']}, decode "
           f"{t['min_decode']}-{t['max_decode']}, at most {t['max_engines']} engines",
           f"planner sees: {m['rate']:.3g} req/s; per engine within the targets: prefill "
           f"{m['prefill_capacity']:.3g}, decode {m['decode_capacity']:.3g} req/s; measured "
           f"TTFT {_fmt_ms(m['ttft_ms'])}, TPOT {_fmt_ms(m['tpot_ms'])}"]
    last = planner.get("last")
    if last is None:
        out.append("planner last decision: none yet")
    else:
        moved = f" ({', '.join(last['engines'])})" if last["engines"] else ""
        out.append(f"planner last decision ({planner['decisions']} in all): {last['action']} "
                   f"{last['count']} {last['role']}{moved}, {last['reason']}, "
                   f"{_ago(last['ago_s'])} ago: {last['detail']}")
    wait = planner["next_action_in_s"]
    why = planner["next_action"]
    when = ("after the change under way" if why == "after the change under way" else
            f"in {wait:.0f}s ({why})" if wait > 0 else "at the next look")
    pending = planner.get("pending")
    out.append(f"planner next action: earliest {when}"
               + (f"; called for once, acts if the next look agrees: {pending}"
                  if pending else ""))
    return out


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None or math.isinf(ms) else f"{ms:.0f} ms"


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}min"
