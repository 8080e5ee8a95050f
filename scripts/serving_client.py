"""The HTTP client side shared by the serving benchmarks (bench_serving.py, bench_multiturn.py):
one streamed completion timed per token, an open-loop load of them, percentiles, and the
comma-separated name lists their flags take."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # the reply's, when asked for
    prompt_tokens: int = 0  # from the usage chunk
    cached_tokens: int = 0  # of them served from a cache (usage.prompt_tokens_details)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def send(session: Any, url: str, model: str, prompt: list[int], max_tokens: int,
               token_ids: bool = False) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": token_ids}
    start = last = time.perf_counter()
    res = Result(ok=False)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return Result(ok=False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Result(ok=False, error=data["error"]["message"])
                if data.get("usage"):
                    u = data["usage"]
                    res.output_tokens = u["completion_tokens"]
                    res.prompt_tokens = u["prompt_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
                if token_ids and data.get("choices"):
                    res.token_ids.extend(data["choices"][0].get("token_ids") or [])
                if data.get("choices") and data["choices"][0]["text"]:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        return Result(ok=False, error=f"{type(e).__name__}: {e}")
    res.ok, res.e2e = True, time.perf_counter() - start
    return res


async def run_load(url: str, model: str, work: list[tuple[float, list[int], int]],
                   progress: bool) -> tuple[list[Result], float]:
    import aiohttp
    from tqdm import tqdm

    bar = tqdm(total=len(work), desc="requests", disable=not progress, leave=False)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(at: float, prompt: list[int], n_out: int) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            r = await send(session, url, model, prompt, n_out)
            bar.update(1)
            return r
        results = await asyncio.gather(*(one(*w) for w in work))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


async def closed_loop(url: str, model: str, work: list[tuple[list[int], int]], clients: int
                      ) -> tuple[list[Result], float]:
    """``work`` (prompt, output tokens) sent by ``clients`` clients, each sending its next
    request when its last one ends; the results in completion order and the seconds taken."""
    import aiohttp
    queue = list(reversed(work))
    results: list[Result] = []

    async def client(session: Any) -> None:
        while queue:
            prompt, n = queue.pop()
            results.append(await send(session, url, model, prompt, n))
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def comma_list(value: str, known: Any, what: str) -> list[str] | None:
    """``value``'s comma-separated names; None (after saying so) when one is not ``known``."""
    names = [m.strip() for m in value.split(",") if m.strip()]
    if unknown := [m for m in names if m not in known]:
        print(f"unknown {what} {unknown}; choose from {list(known)}", file=sys.stderr)
        return None
    return names
