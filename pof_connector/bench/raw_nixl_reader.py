"""The baseline of ``pof bench fabric``: bare NIXL, no pof code on the path."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from pof_connector.bench import BenchError
from pof_connector.config import FabricConfig
from pof_connector.fabric import PeerMeta
from pof_connector.fabric.agent import new_nixl_agent, ucx_init_params
from pof_connector.fabric.remote_reader import POLL_S
from pof_connector.pages.layout import PageSpec


class RawNixlReader:
    """Bare NIXL: an agent of its own (same UCX and progress-thread settings as pof's), prepared descriptor lists over a
    peer's cpu_dram region, READ, poll with pof's sleep. Use it as a context manager."""

    def __init__(self, config: FabricConfig, meta: PeerMeta, spec: PageSpec, batch: int) -> None:
        self.spec = spec
        self.agent: Any = new_nixl_agent(f"bench-raw/{uuid.uuid4().hex[:8]}", config)
        self.agent.create_backend("UCX", ucx_init_params(config))
        self.buf = np.zeros(batch * spec.page_bytes, dtype=np.uint8)
        self.reg = self.agent.register_memory(np.array([[self.buf.ctypes.data, self.buf.nbytes, 0]], np.uint64),
                                              "DRAM")
        name = self.agent.add_remote_agent(meta.metadata)
        self.peer = name.decode() if isinstance(name, bytes) else str(name)
        region = meta.regions["cpu_dram"]
        local = np.zeros((batch, 3), dtype=np.uint64)
        local[:, 0] = self.buf.ctypes.data + np.arange(batch, dtype=np.uint64) * np.uint64(spec.page_bytes)
        local[:, 1] = spec.page_bytes
        remote = np.zeros((region.num_slots, 3), dtype=np.uint64)
        remote[:, 0] = region.base + np.arange(region.num_slots, dtype=np.uint64) * np.uint64(region.slot_bytes)
        remote[:, 1] = spec.page_bytes
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        self.remote = self.agent.prep_xfer_dlist(self.peer, remote, "DRAM")

    def read(self, slots: list[int]) -> None:
        """READ ``slots`` of the owner's region into ``buf`` pages 0.. len(slots)-1."""
        handle = self.agent.make_prepped_xfer("READ", self.local, np.arange(len(slots), dtype=np.int32),
                                              self.remote, np.array(slots, dtype=np.int32))
        try:
            state = self.agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise BenchError("a raw NIXL READ failed")
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
        finally:
            self.agent.release_xfer_handle(handle)

    def page(self, i: int) -> np.ndarray:
        return self.buf[i * self.spec.page_bytes:(i + 1) * self.spec.page_bytes]

    def __enter__(self) -> RawNixlReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in (self.local, self.remote):
            self.agent.release_dlist_handle(handle)
        self.agent.remove_remote_agent(self.peer)
        self.agent.deregister_memory(self.reg)
