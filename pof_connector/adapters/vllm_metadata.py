"""What the scheduler half tells the worker half each step (pickled across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:     # the worker in a harness where vLLM cannot be installed (ci/gpu_check.sh): plain bases
    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's base class."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's base class."""

from pof_connector.config import DEFAULT_TENANT
from pof_connector.index import Location
from pof_connector.pages import PageKey


@dataclass
class LoadJob:
    """Load ``keys[i]`` from ``sources[i]`` into ``block_ids[i]`` (one page = several blocks).

    ``skip_blocks`` leading blocks of the first page already hold the engine's own prefix-cache
    KV; they are left alone.
    """

    req_id: str
    keys: list[PageKey]
    sources: list[Location]
    block_ids: list[list[int]]
    skip_blocks: int = 0

    def first_block(self, page: int) -> int:
        """Position, within page ``page``'s blocks, of the first block the pool writes."""
        return self.skip_blocks if page == 0 else 0

    def blocks_to_load(self, page: int) -> list[int]:
        """The blocks page ``page`` writes (and vLLM must recompute if it fails)."""
        return self.block_ids[page][self.first_block(page):]


@dataclass
class SaveJob:
    """Copy the pages ``keys`` out of ``block_ids`` once this step wrote them.

    ``audit``: pages (index into ``keys``) the pool holds but the engine computed anyway (a sampled
    pool hit, see :mod:`pof_connector.audit`), each with the pool's source the scheduler found
    (rank 0's): compare them with the pool's page instead of storing them twice. ``tenant``: whose
    pages they are (a name: a request's salt never travels to the workers)."""

    req_id: str
    keys: list[PageKey]
    block_ids: list[list[int]]
    audit: dict[int, Location] = field(default_factory=dict)
    tenant: str = DEFAULT_TENANT


@dataclass
class Verdict:
    """The scheduler's word on the saves the workers held in step ``step``: publish them, but drop
    those of ``discard`` (requests that, on some rank, computed on a block whose load failed, or
    shared such a block)."""

    step: int
    discard: list[str] = field(default_factory=list)


@dataclass
class PoFConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    fail_blocks: list[int] = field(default_factory=list)
    """Blocks vLLM was promised but that will not be loaded (the scheduler half failed after its
    answer): the worker reports them as load errors so vLLM recomputes them."""
    tainted: list[str] = field(default_factory=list)
    """Requests whose ``fail_blocks`` are reported this step: whatever they compute on top of those
    blocks is not the page its key names, so the worker stores none of it until ``rewound``."""
    rewound: list[str] = field(default_factory=list)
    """Requests vLLM rewound (after a failed load, or a preemption) since the last step: what they
    compute from now on is computed afresh, on validated KV only, and may be stored again."""
    finished: list[str] = field(default_factory=list)
    """Requests that ended since the last step (the worker forgets them)."""
    step: int = 0
    """The scheduler's number for this step (0: a metadata built by hand, in tests)."""
    hold: bool = False
    """Store this step's saves held, unpublished, until a :class:`Verdict` for :attr:`step`: this
    step, or one whose output the scheduler has not seen yet, promised KV from the pool, so some
    rank's load may have failed under a block this step's compute read."""
    verdicts: list[Verdict] = field(default_factory=list)
    """The scheduler's word on earlier held steps, oldest first."""


@dataclass
class PoFWorkerMeta(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler half after a step (vLLM aggregates every rank's):
    which step this was, and the pages rank 0 stored held in it, per request, in ``medium``."""

    step: int
    held: dict[str, list[PageKey]] = field(default_factory=dict)
    medium: str = ""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PoFWorkerMeta:
        if not isinstance(other, PoFWorkerMeta):
            return self
        held = {**other.held, **self.held}
        # Every rank runs the same step; should two ever differ, the older one is the safe answer.
        return PoFWorkerMeta(min(self.step, other.step), held, self.medium or other.medium)
