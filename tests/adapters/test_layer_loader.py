"""``LayerLoader`` (the vLLM worker's background copy of a step's loads): layers in model order,
each waiter released as soon as its layer is done, a failure on the thread handed to the engine
thread, and cancel stopping the copy before the readers close. No engine needed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pof_connector.adapters.layer_loader import LayerLoader


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(1)
    yield ex
    ex.shutdown(wait=True)


def test_layers_are_copied_in_order_and_released_one_by_one(executor: ThreadPoolExecutor) -> None:
    copied: list[int] = []
    gate = threading.Event()

    def copy(layer: int) -> None:
        if layer == 2:
            assert gate.wait(10)           # layer 2 is slow (the engine is computing layer 1)
        copied.append(layer)

    loader = LayerLoader(copy, 4, executor)
    loader.wait(1)                         # returns while layer 2 is still being copied
    assert copied == [0, 1]
    waiter = threading.Thread(target=loader.wait, args=(3,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()               # layer 3 is not released before it was copied
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive()
    loader.finish()
    assert copied == [0, 1, 2, 3]
    assert loader.complete


def test_finish_waits_for_layers_nobody_asked_for(executor: ThreadPoolExecutor) -> None:
    copied: list[int] = []
    loader = LayerLoader(copied.append, 3, executor)
    loader.finish()
    assert copied == [0, 1, 2]


def test_an_error_on_the_thread_reaches_the_engine_thread(executor: ThreadPoolExecutor) -> None:
    copied: list[int] = []

    def copy(layer: int) -> None:
        if layer == 1:
            raise IndexError("block 99 is past the end of the cache")
        copied.append(layer)

    loader = LayerLoader(copy, 3, executor)
    for layer in (1, 2):                     # waiters of the failed layer and of later ones are released
        with pytest.raises(RuntimeError, match="block 99") as e:
            loader.wait(layer)
        assert isinstance(e.value.__cause__, IndexError)
    with pytest.raises(RuntimeError):
        loader.finish()
    assert copied == [0]                     # nothing after the failure
    assert not loader.complete


def test_cancel_stops_after_the_layer_in_progress(executor: ThreadPoolExecutor) -> None:
    copied: list[int] = []
    started, gate = threading.Event(), threading.Event()

    def copy(layer: int) -> None:
        if layer == 1:
            started.set()
            assert gate.wait(10)
        copied.append(layer)

    loader = LayerLoader(copy, 4, executor)
    assert started.wait(10)
    canceller = threading.Thread(target=loader.cancel)
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive()              # cancel waits for the copy in progress
    gate.set()
    canceller.join(10)
    assert not canceller.is_alive()
    assert copied == [0, 1]                  # once cancel returns, the thread touches nothing more
    loader.wait(3)                           # nobody is left waiting
    assert not loader.complete


def test_inline_copies_each_layer_when_it_is_waited_for() -> None:
    """Without an executor (no free core) the engine's thread copies each layer right before it
    reads it, in order; finish copies the layers nobody asked for."""
    copied: list[int] = []
    loader = LayerLoader(copied.append, 4)
    assert copied == []
    loader.wait(0)
    assert copied == [0]
    loader.wait(2)                           # a skipped wait still copies in model order
    assert copied == [0, 1, 2]
    loader.wait(1)
    assert copied == [0, 1, 2]
    assert not loader.complete
    loader.finish()
    assert copied == [0, 1, 2, 3]
    assert loader.complete


def test_inline_errors_are_raised_where_they_happen() -> None:
    def copy(layer: int) -> None:
        raise IndexError("block 99 is past the end of the cache")

    loader = LayerLoader(copy, 2)
    with pytest.raises(IndexError):
        loader.wait(0)
    loader.cancel()
    loader.finish()                          # cancelled: copies nothing more
    assert not loader.complete
