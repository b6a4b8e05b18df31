"""Very large prompts are tokenized in a helper process.

The Rust tokenizer keeps Python's GIL for long stretches of a multi-megabyte input (measured here: up to
the whole 7-10 s encode of a 7 MB prompt, from a worker thread), which would stall every stream on the
router's event loop; a thread is not enough. Prompts of at least `threshold` characters therefore go
to one child process that loads the same tokenizer; smaller ones stay on the router's tokenizer threads,
where the encode is short. The child starts on the first large prompt.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from xavier_core.text.tokenizer import TextTokenizer

# The child's tokenizer: per-process state of the pool's single worker, set by its initializer.
_CHILD_TOKENIZER: list[TextTokenizer] = []


def _load(model_dir: str) -> None:
    _CHILD_TOKENIZER.append(TextTokenizer.load(Path(model_dir)))


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return _CHILD_TOKENIZER[0].encode(text, add_special_tokens=add_special_tokens)


class ProcessEncoder:
    """Encodes text in a child process (blocking: call it from a tokenizer thread, never the loop)."""

    def __init__(self, model_dir: Path, threshold: int) -> None:
        self.model_dir = model_dir
        self.threshold = threshold
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def wants(self, text: str) -> bool:
        return len(text) >= self.threshold

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_load,
                    initargs=(str(self.model_dir),),
                )
            pool = self._pool
        return pool.submit(_encode, text, add_special_tokens).result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
