"""Tokenization off the event loop: prompts are encoded (and chat templates
rendered) in a pool of threads. The Rust tokenizer releases the GIL while it
encodes, so a burst of text prompts is tokenized on several cores while the
loop goes on reading requests and streaming tokens. Inline, every 512-token
prompt of random text (what vLLM's benchmark sends) held the loop for about
2 ms on the H200 host, and 1000 of them took 3.9 s to reach the engine.

The encode calls share one tokenizer: concurrent encodes are safe as long as
none changes its truncation or padding, which the server never asks for."""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor


class TokenizerPool:
    def __init__(self, tokenizer, threads: int | None = None):
        """threads: how many prompts encode at once (default: the CPUs, at
        most 8: beyond that the API process's own thread is the bound)."""
        if threads is not None and threads < 1:
            raise ValueError(f"tokenizer threads must be at least 1, got {threads}")
        self.tokenizer = tokenizer
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pagoda-tokenizer")

    async def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on a pool thread; what it raises is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
