"""Several choices in one HTTP request: a list of prompts and/or ``n`` samples per prompt.

Each choice is its own engine request (id ``<request id>-<index>``); the choices of one prompt
share its prefill (legs.SharedPrefix: one prefill on P, the others reuse its KV on D). Their
events are merged in arrival order and tagged with the choice index, as OpenAI numbers them
(prompt-major: prompt i, sample j -> index i * n + j). Greedy choices of one prompt are
identical; sampled ones get seeds ``seed + j``, so they differ from each other and a request
with a seed is reproducible. The first failure ends the whole request (the others are
cancelled, which aborts them on every engine).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from pd_cluster.sampling_params import SamplingParams
from pd_cluster.serving.routing.legs import GenerateJob, SharedPrefix, StreamEvent


def choice_jobs(request_id: str, prompts: list[tuple[list[int], SamplingParams]], n: int,
                deadline: float) -> list[GenerateJob]:
    """One job per choice: each prompt (with its own params) n times, prompt-major."""
    jobs = []
    for i, (prompt, params) in enumerate(prompts):
        ids = [request_id if len(prompts) * n == 1 else f"{request_id}-{i * n + j}"
               for j in range(n)]
        prefix = SharedPrefix(leader=ids[0]) if n > 1 else None
        for j, rid in enumerate(ids):
            p = params if params.seed is None or j == 0 else \
                dataclasses.replace(params, seed=params.seed + j)
            # the choices share the prompt list
            jobs.append(GenerateJob(rid, prompt, p, deadline, prefix=prefix))
    return jobs


async def merged(jobs: list[GenerateJob],
                 stream: Callable[[GenerateJob], AsyncIterator[StreamEvent]]
                 ) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(choice index, event) from every job's stream, as they come."""
    if len(jobs) == 1:  # the common case: no tasks, no queue
        async for ev in stream(jobs[0]):
            yield 0, ev
        return
    # Bounded: a client slower than its choices leaves their streams waiting here, so their
    # output coalesces in the dispatcher (one event later) instead of queueing per step.
    q: asyncio.Queue[tuple[int, StreamEvent | None, BaseException | None]] = \
        asyncio.Queue(maxsize=len(jobs))

    async def pump(index: int, job: GenerateJob) -> None:
        try:
            async for ev in stream(job):
                await q.put((index, ev, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
            await q.put((index, None, e))
            return
        await q.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(tasks)
        while running:
            index, ev, error = await q.get()
            if error is not None:
                raise error
            if ev is None:
                running -= 1
                continue
            yield index, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
