"""The handle of one :meth:`Pool.load <pof_connector.pool.Pool.load>`, and the I/O-thread copy that
fills it."""

from __future__ import annotations

import threading

import numpy as np

from pof_connector.pages.layout import PageSpec
from pof_connector.pool.page_reader import PageReader


class LoadHandle:
    """Progress of one :meth:`Pool.load <pof_connector.pool.Pool.load>`.

    Layers complete in order; after :meth:`wait_layer` returns ``True`` for layer ``l``, segment
    ``l`` of every page not in :attr:`failed` is in its buffer and was validated. A failed page's
    buffer content is undefined: the engine must recompute it.
    """

    def __init__(self, num_pages: int, num_layers: int) -> None:
        self.num_pages = num_pages
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._done = threading.Event()
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Wait until ``layer`` of every page arrived; ``False`` on timeout."""
        return self._layers[layer].wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def failed(self) -> dict[int, str]:
        """Page index → reason, for pages the engine must recompute."""
        with self._lock:
            return dict(self._failed)

    def _fail(self, page: int, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(page, reason)

    def _finish(self, reason: str = "aborted") -> None:
        """Release every waiter; pages whose layers did not all arrive count as failed."""
        for i, ev in enumerate(self._layers):
            if not ev.is_set():
                for p in range(self.num_pages):
                    self._fail(p, reason)
                for later in self._layers[i:]:
                    later.set()
                break
        self._done.set()


def finished(handle: LoadHandle, reason: str = "aborted") -> LoadHandle:
    """``handle`` with every waiter released (see :meth:`LoadHandle._finish`)."""
    handle._finish(reason)
    return handle


def copy_layers(handle: LoadHandle, reader: PageReader, pages: list[np.ndarray], spec: PageSpec) -> None:
    """The I/O-thread flavour of a :class:`PageReader` read: each layer of each page is copied
    into its buffer and checked, and the handle releases a layer once every page has it. The
    caller finishes the handle (whatever happens here) and closes the reader."""
    for layer in range(spec.num_layers):
        for i, page in enumerate(pages):
            reader.copy_into(i, layer, spec.segment(page, layer))    # copied and summed in one pass
        for i, reason in reader.failed.items():
            handle._fail(i, reason)
        handle._layers[layer].set()
