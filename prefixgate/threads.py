"""torch's CPU threads: the model thread computes on every core, and every other thread of a server on one.

torch runs a thread's CPU kernels on an OpenMP pool of that thread's own, made the first time it runs a kernel on
more than one thread, and kept for the thread's life. libgomp keeps a pool's workers spinning between kernels only
while the process's pool threads number no more than its cores; past that they sleep, and each of a model step's
hundreds of small kernels waits for them to wake. On 2 cores, the pool of the executor thread that loaded the model
was enough to make every decode step about 20% slower. So a server's model thread keeps the only pool: the model is
loaded in a thread that ends, and the threads that copy blocks or prepare prompts run torch on one thread, which
makes no pool (their copies are memory-bound anyway).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch


def use_threads(count: int) -> None:
    """Run this thread's torch CPU kernels on `count` threads from now on."""
    # A thread takes torch's process-wide default on its first kernel (or first query), which would undo a count set
    # before it: query first, then set.
    torch.get_num_threads()
    torch.set_num_threads(count)


def io_threads(loop: asyncio.AbstractEventLoop) -> None:
    """Have `loop`'s worker threads (`asyncio.to_thread`: an engine's prompts prepared and blocks copied there) run
    torch on one CPU thread from now on, making no OpenMP pool beside the model thread's. Call it once the model is
    loaded: a model loaded from such a thread would load, and run, on one. Without it an engine on a loop of its own
    (SmolLM2, 2 cores of an AMD EPYC) decoded 8 streams on a cached 4k-token prefix in steps of 37 to 47 ms, against 21
    with it."""
    loop.set_default_executor(torch_executor("prefixgate-io"))


def torch_executor(name: str, *, threads: int = 1, workers: int | None = None) -> ThreadPoolExecutor:
    """Return a pool of `workers` threads (the standard library's default count when None), named after `name`, each
    running torch's CPU kernels on `threads` threads: one, unless it is the model's."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=use_threads, initargs=(threads,))
