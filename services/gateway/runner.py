"""Run a request's jobs through the asyncio SDK and merge their deltas into one ordered feed.

The first choice of each prompt is submitted alone; the others follow once it has produced its
first delta, when its prompt's KV blocks are computed and in the prefix cache, so n choices
share one prefill. They go as continuations of an admitted call (m.Generate.continues), which a
stopping run still takes. Closing the feed (a client disconnect cancels it) aborts every job. Any
exception a job raises ends the request with an error: a job task that died silently would
leave the feed waiting forever, the client without a byte, and the request's slot taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from client.async_sdk import AsyncClient
from client.errors import BrigadeError
from client.sdk import StreamDelta
from services.gateway.jobs import Job

log = logging.getLogger(__name__)


async def run_jobs(client: AsyncClient, jobs: list[Job]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Yield (choice index, delta) as they come, until every job finished; raises the first
    job's BrigadeError."""
    feed: asyncio.Queue[tuple[int, StreamDelta | None, BrigadeError | None]] = asyncio.Queue()
    prefilled = {job.prompt_index: asyncio.Event() for job in jobs}
    leaders = {job.prompt_index: job.index for job in reversed(jobs)}
    refused: set[int] = set()  # prompts whose first choice failed: the call fails, nothing more is sent

    async def run(job: Job) -> None:
        is_leader = leaders[job.prompt_index] == job.index
        if not is_leader:
            await prefilled[job.prompt_index].wait()
            if job.prompt_index in refused:
                return
        try:
            # A later choice goes once the call was admitted (its first choice's first delta;
            # after an error the call fails and this one is aborted): a stopping run finishes it.
            stream = client.stream(job.prompt, messages=job.messages, continues=not is_leader, **job.sampling)
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    if delta.prompt_progress is None:  # a report of progress is no output yet
                        prefilled[job.prompt_index].set()
                    feed.put_nowait((job.index, delta, None))
        except BrigadeError as exc:
            fail(job, is_leader, exc)
        except Exception as exc:  # a bug, or input no check foresaw: the request fails, loudly
            log.exception("choice %d of a request failed", job.index)
            fail(job, is_leader, BrigadeError(f"internal error: {type(exc).__name__}: {exc}"))

    def fail(job: Job, is_leader: bool, error: BrigadeError) -> None:
        if is_leader and not prefilled[job.prompt_index].is_set():
            # Refused before its first output (too long, overloaded, a stopping run): its other
            # choices would be refused too, or, as continuations, taken by a stopping run for nothing.
            refused.add(job.prompt_index)
        prefilled[job.prompt_index].set()
        feed.put_nowait((job.index, None, error))

    tasks = [asyncio.create_task(run(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            index, delta, error = await feed.get()
            if error is not None:
                raise error
            assert delta is not None
            if delta.finish_reason is not None:
                remaining -= 1
            yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
