"""``LayerLoader``: one step's loads copied layer by layer on a thread of their own, so the copy of
layer ``l + 1`` runs while the engine computes layer ``l``.

vLLM calls the connector's ``start_load_kv`` right before a forward and ``wait_for_layer_load``
inside each attention layer, before it reads the KV cache. The loader starts copying at the first
call and releases each layer as soon as every page has it; the forward waits only for what it is
about to read. The copy itself (the native ``kt_copy_checksum``, numpy, torch) releases the GIL,
so the forward's Python keeps running between copies.

Failures keep their meaning: a page that fails a check is left to the caller's reader (the
engine recomputes it); an unexpected error on the thread releases every waiter and is raised to
the engine thread at its next :meth:`wait` or at :meth:`finish`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class LayerLoader:
    """Runs ``copy_layer(0)``, ``copy_layer(1)``, ... ``copy_layer(layers - 1)`` on ``executor``."""

    def __init__(self, executor: ThreadPoolExecutor, copy_layer: Callable[[int], None], layers: int) -> None:
        self._copy_layer = copy_layer
        self._done = [threading.Event() for _ in range(layers)]
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._future: Future[None] = executor.submit(self._run)

    def _run(self) -> None:
        try:
            for layer, done in enumerate(self._done):
                if self._cancelled.is_set():
                    break
                self._copy_layer(layer)
                done.set()
        except BaseException as e:       # handed to the engine thread, which reports it
            self._error = e
        finally:
            for done in self._done:      # never leave a waiter hanging
                done.set()

    def wait(self, layer: int) -> None:
        """Return once ``layer`` was copied (and checked) for every page; raise the thread's
        unexpected error, if any."""
        self._done[layer].wait()
        self._raise()

    def finish(self) -> None:
        """Wait for every layer (those the engine did not ask for too); raise the thread's error."""
        self._future.result()
        self._raise()

    def cancel(self) -> None:
        """Stop after the layer in progress and wait for the thread: the caller may then close
        the readers. The layers not copied are the caller's to report as failed."""
        self._cancelled.set()
        self._future.result()

    @property
    def complete(self) -> bool:
        """Whether every layer was copied (not cancelled, no error)."""
        return self._future.done() and not self._cancelled.is_set() and self._error is None

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pof: the layer loader failed: {self._error!r}") from self._error
