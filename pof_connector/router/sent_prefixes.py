"""Which prompt prefixes `pof router` already sent to each backend: what its engine probably caches.

The cost model learns from each streamed request's TTFT. When the engine does not report the
prompt tokens it had cached (vLLM without ``--enable-prompt-tokens-details``, or a client not
asking for usage), a prompt sent before (a benchmark re-run, a conversation's next turn) answers
in milliseconds while the model counts all of it as prefill: the learnt cost per token collapses.
This memory supplies the count instead: the leading tokens of the prompt that the router sent to
the same backend before, in chunks of ``chunk_tokens``. It is a guess (the engine may have
evicted them; then the sample errs the other way), used only for learning, never for routing.

Chunks are identified by a chained in-process hash (Python's ``hash`` of the previous link and
the chunk's tokens): it never leaves the process, so no cross-process stability is needed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class SentPrefixes:
    def __init__(self, chunk_tokens: int = 16, max_chunks: int = 1 << 16) -> None:
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks
        """Chunks remembered per backend (least recently sent forgotten first)."""
        self._seen: dict[str, OrderedDict[int, None]] = {}
        self._lock = threading.Lock()

    def _chain(self, tokens: list[int]) -> list[int]:
        links, h, c = [], 0, self.chunk_tokens
        for i in range(0, len(tokens) - c + 1, c):
            h = hash((h, tuple(tokens[i:i + c])))
            links.append(h)
        return links

    def cached_then_record(self, backend: str, tokens: list[int]) -> int:
        """Leading tokens of ``tokens`` sent to ``backend`` before; then remember these."""
        links = self._chain(tokens)
        with self._lock:
            seen = self._seen.setdefault(backend, OrderedDict())
            hit = 0
            for link in links:
                if link not in seen:
                    break
                hit += 1
            for link in links:
                seen[link] = None
                seen.move_to_end(link)
            while len(seen) > self.max_chunks:
                seen.popitem(last=False)
        return hit * self.chunk_tokens
