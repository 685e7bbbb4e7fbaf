"""Test-only faults in the vLLM worker's writes: wrong KV stored under a right key, with every
checksum right, as the bugs the audit exists for would store it. Off unless the environment names
a file (``POF_TEST_WRITER_FAULTS``); the file holds the fault of the next steps (empty: none), so
a test switches faults on a running server. Each fault acts *before* the pool sums the page: it
stands in for a writer bug, never for bytes damaged after their checksum.

* ``wrong_blocks``: each page is saved from the blocks of the next page of its request;
* ``other_prefix``: each page holds the KV of a page of an earlier request (another prefix);
* ``failed_load``: loads zero the engine's blocks instead of filling them and report nothing, so
  the pages computed on top of them are stored (a load that failed silently);
* ``swap_layers``: layer 0 and layer 1 of each page trade places;
* ``swap_heads``: KV heads 0 and 1 of each layer trade places (MLA or one head: the two halves of
  each token's values).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ENV = "POF_TEST_WRITER_FAULTS"
FAULTS = ("wrong_blocks", "other_prefix", "failed_load", "swap_layers", "swap_heads")


class WriterFaults:
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.fault = ""
        self._stash: np.ndarray | None = None      # one page's segments of an earlier request

    @classmethod
    def from_env(cls) -> WriterFaults | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def begin_step(self) -> str:
        """Read the fault for this step."""
        try:
            fault = self.path.read_text().strip()
        except OSError:
            fault = ""
        self.fault = fault if fault in FAULTS else ""
        return self.fault

    def blocks(self, block_ids: list[list[int]]) -> list[list[int]]:
        if self.fault != "wrong_blocks" or len(block_ids) < 2:
            return block_ids
        return block_ids[1:] + block_ids[:1]

    def zeroes_loads(self) -> bool:
        return self.fault == "failed_load"

    def damage(self, segments: np.ndarray, canonical: tuple[int, ...], itemsize: int) -> None:
        """Apply this step's fault to a save's staging ``[layers, pages, segment_bytes]``
        (``canonical``: a segment's ``[K/V, tokens, heads, dim]``)."""
        layers, pages, _ = segments.shape
        if self.fault == "other_prefix" and self._stash is not None:
            segments[:] = self._stash[:, None, :]
        elif self.fault == "swap_layers" and layers > 1:
            segments[[0, 1]] = segments[[1, 0]]
        elif self.fault == "swap_heads":
            kv, tokens, heads, dim = canonical
            values = segments.reshape(layers, pages, kv * tokens, heads, dim * itemsize)
            if heads > 1:
                values[:, :, :, [0, 1]] = values[:, :, :, [1, 0]]
            else:
                half = dim * itemsize // 2
                first = values[..., :half].copy()
                values[..., :half] = values[..., half:2 * half]
                values[..., half:2 * half] = first
        elif not self.fault and pages:
            self._stash = segments[:, 0].copy()
