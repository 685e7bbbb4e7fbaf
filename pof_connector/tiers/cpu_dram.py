"""CPU DRAM: one large host buffer split into fixed slots, private to this process."""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any

import numpy as np

from pof_connector.config import ConfigError, format_size
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers.base import Tier, slot_bytes_for

log = logging.getLogger(__name__)


def host_buffer(nbytes: int) -> tuple[np.ndarray, Any]:
    """A zeroed host buffer, page-locked when the process already uses CUDA through torch.

    Returns the numpy view and the object that owns the memory (keep it alive). Torch is only
    consulted when the engine already imported it: the core never imports torch itself.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        t = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
        return t.numpy(), t
    arr = np.zeros(nbytes, dtype=np.uint8)
    return arr, arr


class CpuDramTier(Tier):
    medium = "cpu_dram"

    def __init__(self, spec: PageSpec, size: int) -> None:
        slot_bytes = slot_bytes_for(spec)
        num_slots = size // slot_bytes
        if num_slots < 1:
            raise ConfigError(f"tiers.cpu_dram.size: {format_size(size)} cannot hold one page of "
                              f"{format_size(slot_bytes)}; allowed: at least {slot_bytes} bytes")
        region, self._owner = host_buffer(num_slots * slot_bytes)
        super().__init__(spec, region, np.zeros(num_slots, dtype=np.uint64), slot_bytes, range(num_slots))
        self._domain = f"dram:{uuid.uuid4().hex}"
        log.info("cpu_dram tier: %d slots of %s (%s)", num_slots, format_size(slot_bytes),
                 format_size(num_slots * slot_bytes))

    @property
    def domain(self) -> str:
        return self._domain
