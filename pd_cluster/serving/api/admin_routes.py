"""Admin routes: engines added, removed and switched between roles on the running cluster.

    POST /admin/scale        {"prefill": N, "decode": M}   (or {"colocated": K})
    POST /admin/switch_role  {"engine": "decode-1", "role": "prefill"}
    GET  /admin/engines      every engine's id, role and state (serving/draining/starting)

Keyed as every other route (``Authorization: Bearer KEY``, auth.py). A proxy without API keys
answers them only on loopback: anyone who reaches an open proxy from the network must not
be able to stop its engines. Bad input is a 400 naming the field; an engine that cannot be
added (no room, failed start) or drained in time is a 503 saying why.
"""
from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from pd_cluster.serving.api.errors import APIError, invalid_request
from pd_cluster.serving.api.request_body import read_body
from pd_cluster.serving.api.utility_routes import _parse
from pd_cluster.serving.cluster.engine_starter import ScaleError
from pd_cluster.serving.routing.engine_drain import DrainTimeout


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prefill: int | None = Field(None, ge=0)
    decode: int | None = Field(None, ge=0)
    colocated: int | None = Field(None, ge=0)


class SwitchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    engine: str
    role: str


def add_admin_routes(app: FastAPI, state: Any, keyed: bool) -> None:
    actuator = state.actuator

    def guard() -> None:
        if not keyed and not _loopback(state.cfg.proxy.host):
            raise APIError(403, "admin routes need an API key on a proxy reachable from the "
                                "network: set proxy.api_key or proxy.api_key_env",
                           "permission_error")

    @app.get("/admin/engines")
    async def engines() -> dict[str, Any]:
        guard()
        return {"engines": [asdict(v) for v in actuator.engines()]}

    @app.post("/admin/scale")
    async def scale(request: Request) -> dict[str, Any]:
        guard()
        req = _parse(ScaleRequest, await read_body(request, state.cfg.proxy.max_body_bytes))
        counts = {k: v for k, v in req.model_dump().items() if v is not None}
        if not counts:
            raise invalid_request("give at least one of prefill, decode, colocated", "prefill")
        done = await _run(actuator.scale_to(counts), field=next(iter(counts)))
        return {"done": done, "engines": [asdict(v) for v in actuator.engines()]}

    @app.post("/admin/switch_role")
    async def switch_role(request: Request) -> dict[str, Any]:
        guard()
        req = _parse(SwitchRequest, await read_body(request, state.cfg.proxy.max_body_bytes))
        done = await _run(actuator.switch(req.engine, req.role), field="engine")
        return {"done": done, "engines": [asdict(v) for v in actuator.engines()]}


async def _run(coro: Any, field: str) -> list[str]:
    try:  # shielded: a client hanging up must not cancel a scaling operation half-way
        return await asyncio.shield(asyncio.ensure_future(coro))
    except ValueError as e:
        msg = str(e)
        raise invalid_request(msg, msg.split(":", 1)[0] if ":" in msg else field) from None
    except (ScaleError, DrainTimeout) as e:
        raise APIError(503, str(e), "service_unavailable") from None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
