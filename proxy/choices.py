"""A request's choices (OpenAI's `n`): generations of one prompt, started together and read as their chunks come.

Each choice is a request of its own to the engine, so the cache does for them what it does for any requests on one
prompt. The first computes the prompt, and files its partial last block with the whole ones before its first token;
the others start then, and compute only the prompt's last token, whose logits each samples its own first token from:
on a local model they read the prompt's whole blocks in place and attend to them once a step for all (README, "Many
streams on one prefix"); an upstream finds the prompt in its own cache. With a seed, choice i is seeded as a request
with seed + i would be, as vLLM seeds them. The statistics count the request once, with the first choice's prompt and
cached tokens, and every choice's completion tokens. Where the prompt's log probabilities are asked for (`echo` with
`logprobs`, vLLM's `prompt_logprobs`), the first choice scores the prompt (it computes all of it, and files it), and
the others read it as above and carry its entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from prefixgate.backends import TokenChunk, TokenLogprob
from prefixgate.proxy.engine import Engine, Generation, PromptRequest, Usage
from prefixgate.proxy.upstream_engine import UpstreamEngine, UpstreamGeneration

AnyEngine = Engine | UpstreamEngine  # a local model's, or one in front of upstreams
AnyGeneration = Generation | UpstreamGeneration
_SEEDS = 2**64  # seeds are 64-bit patterns: past the largest, choice i's wraps to the smallest unsigned ones


class Choices:
    """The generations of one request's choices, in order; closing them stops every one."""

    def __init__(self, generations: Sequence[AnyGeneration], prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        self.generations = tuple(generations)
        self._prompt_logprobs = prompt_logprobs  # the first choice's, which every choice's first chunk carries
        self._reading: dict[asyncio.Future[TokenChunk | None], int] = {}  # each choice's next chunk, being read

    @classmethod
    async def start(cls, engine: AnyEngine, request: PromptRequest, n: int) -> Choices:
        """Start `n` generations of the request on the engine, each up to its first token: the first alone, then the
        others together, which find the whole prompt cached but its last token (theirs to compute: its logits are
        theirs to sample); if one fails, the others are stopped and its error raised."""
        if n == 1:
            return cls([await _generate(engine, request)])
        first = await _generate(engine, replace(request, prompt_tail=True))  # its partial last block filed too
        tasks: list[asyncio.Task[AnyGeneration]] = []
        try:
            if isinstance(engine, Engine):
                await engine.wait_for_blocks()
            # The prompt's log probabilities are the first choice's: the others read its blocks instead of scoring it.
            others = replace(request, params=replace(request.params, prompt_logprobs=None))
            tasks = [asyncio.ensure_future(_generate(engine, _choice(others, index))) for index in range(1, n)]
            scored = first.prompt_logprobs if isinstance(first, Generation) else ()
            return cls([first, *await asyncio.gather(*tasks)], scored)
        except BaseException:
            for task in tasks:
                task.cancel()
            for started in await asyncio.gather(*tasks, return_exceptions=True):
                if not isinstance(started, BaseException):
                    await started.aclose()
            await first.aclose()
            raise

    @property
    def first(self) -> AnyGeneration:
        """Return the first choice, which started alone and computed what the prompt lacked: its id, timing and
        cache headers are the request's."""
        return self.generations[0]

    def usage(self) -> Usage:
        """Return the request's token counts: its prompt once, as `first` read it, and every choice's answer."""
        completion = sum(generation.usage().completion_tokens for generation in self.generations)
        return replace(self.first.usage(), completion_tokens=completion)

    async def chunks(self) -> AsyncIterator[tuple[int, TokenChunk]]:
        """Yield each choice's chunks with its index, as they come: the choices decode side by side."""
        if len(self.generations) == 1:
            async for chunk in self.generations[0]:
                yield 0, chunk
            return
        reading = self._reading
        for index, generation in enumerate(self.generations):
            reading[asyncio.ensure_future(_next(generation))] = index
        unscored = set(range(1, len(self.generations))) if self._prompt_logprobs else set()
        try:
            while reading:
                done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reading.__getitem__):
                    index = reading.pop(task)
                    got = task.result()
                    if got is not None:
                        reading[asyncio.ensure_future(_next(self.generations[index]))] = index
                        if index in unscored:  # its first chunk: the prompt's log probabilities, as the first's
                            unscored.discard(index)
                            got = replace(got, prompt_logprobs=self._prompt_logprobs)
                        yield index, got
        finally:
            await self._stop_reading()

    async def aclose(self) -> None:
        """Stop every choice (each stops within a step of its model); what they computed stays cached."""
        # A reader that stopped reading `chunks` (a write to a client that left failed) leaves it suspended, with the
        # other choices' reads inside their generations: a generation cannot be closed while one runs in it.
        await self._stop_reading()
        for generation in self.generations:
            await generation.aclose()

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _stop_reading(self) -> None:
        """Cancel the reads of next chunks under way, and wait until each has left its generation."""
        reads = list(self._reading)
        self._reading.clear()
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


def _choice(request: PromptRequest, index: int) -> PromptRequest:
    seed = request.params.seed
    if seed is None:
        return replace(request, choice=index)
    shifted = seed + index if seed + index < _SEEDS else seed + index - _SEEDS
    return replace(request, params=replace(request.params, seed=shifted), choice=index)


async def _generate(engine: AnyEngine, request: PromptRequest) -> AnyGeneration:
    return await engine.generate(request)


async def _next(generation: AnyGeneration) -> TokenChunk | None:
    """Return the generation's next chunk, or None after its last."""
    return await anext(generation, None)
