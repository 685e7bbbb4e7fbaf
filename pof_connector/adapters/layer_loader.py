"""``LayerLoader``: one step's loads copied layer by layer, in model order, either on a thread of
their own (the copy of layer ``l + 1`` runs while the engine computes layer ``l``) or on the
engine's thread, each layer right before the engine reads it.

vLLM calls the connector's ``start_load_kv`` right before a forward and ``wait_for_layer_load``
inside each attention layer, before it reads the KV cache. With an executor the loader starts
copying at once and releases each layer as soon as every page has it; the forward waits only for
what it is about to read. The copy itself (the native ``kt_copy_pages``, numpy, torch)
releases the GIL, so the forward's Python keeps running between copies. That only pays when a
core is free for it: where the forward keeps every core busy (vLLM on the CPU), a copy thread
stalls the engine's OpenMP threads for longer than the copy takes, and the caller passes no
executor (see ``PoFWorker``).

Failures keep their meaning: a page that fails a check is left to the caller's reader (the
engine recomputes it); an unexpected error on the thread releases every waiter and is raised to
the engine thread at its next :meth:`wait` or at :meth:`finish` (inline, it is raised where it
happens).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pof_connector.pages import page_sum


class LayerLoader:
    """Runs ``copy_layer(0)``, ``copy_layer(1)``, ... ``copy_layer(layers - 1)`` in that order: on
    ``executor`` from the start, or (``executor`` ``None``) on the caller's thread, as far as
    each :meth:`wait` needs."""

    def __init__(self, copy_layer: Callable[[int], None], layers: int,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self._copy_layer = copy_layer
        self._done = [threading.Event() for _ in range(layers)]
        self._cancelled = threading.Event()
        self._error: BaseException | None = None
        self._next = 0          # inline: the next layer to copy
        self._future: Future[None] | None = None if executor is None else executor.submit(self._run)

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

    def _copy_through(self, layer: int) -> None:
        """Inline: copy every layer up to ``layer`` not copied yet."""
        while self._next <= layer and not self._cancelled.is_set():
            self._copy_layer(self._next)
            self._done[self._next].set()
            self._next += 1

    def wait(self, layer: int) -> None:
        """Return once ``layer`` was copied (and checked) for every page; raise the copy's
        unexpected error, if any."""
        if self._future is None:
            self._copy_through(layer)
            return
        self._done[layer].wait()
        self._raise()

    def finish(self) -> None:
        """Copy or wait for every layer (those the engine did not ask for too); raise the copy's
        unexpected error."""
        if self._future is None:
            self._copy_through(len(self._done) - 1)
            return
        self._future.result()
        self._raise()

    def cancel(self) -> None:
        """Stop after the layer in progress and wait for the thread: the caller may then close
        the readers. The layers not copied are the caller's to report as failed."""
        self._cancelled.set()
        if self._future is not None:
            self._future.result()

    @property
    def complete(self) -> bool:
        """Whether every layer was copied (not cancelled, no error)."""
        if self._future is None:
            return self._next == len(self._done)
        return self._future.done() and not self._cancelled.is_set() and self._error is None

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"pof: the layer loader failed: {self._error!r}") from self._error


def core_to_spare(device: Any) -> bool:
    """Whether a load copied on a thread of its own overlaps the forward instead of slowing it:
    the forward runs on a GPU (the host cores mostly wait), or torch's threads leave one of this
    process's cores idle."""
    if device.type != "cpu":
        return True
    import torch  # the engine's torch: the loader itself runs without it

    return len(os.sched_getaffinity(0)) > torch.get_num_threads()


def copy_threads(device: Any) -> int:
    """How many threads copy a layer's pages when the forward's thread waits for the copy: on a
    CPU engine, as many as torch computes with (their cores idle while the forward waits, and one
    core does not fill the memory bandwidth): the caller and the native kernel's own helpers
    (:func:`pof_connector.pages.page_sum.kt_copy_pages`), which never hold the caller up when the OS
    gives their core to another process; else one."""
    if device.type != "cpu" or page_sum.NATIVE is None:
        return 1
    import torch

    return max(1, torch.get_num_threads())
