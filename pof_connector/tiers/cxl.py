"""CXL memory: an mmap of a devdax device or a file, shared by several processes.

Region layout (version 2)::

    [0, 1024)            superblock: magic, version, partitions, slot_bytes, num_slots,
                         offsets, region uuid
    [1024, 4096)         trade records: four u64 per partition (evictions, age of the page last
                         evicted in ns, slots given away, reserved); up to 96 partitions
    [4096, owners_at)    generation table: one u64 per slot
    [owners_at, data_at) owner table: one u16 per slot, the partition whose writer keeps its books
    [data_offset, ...)   num_slots slots of slot_bytes

Each writer owns one partition and keeps its own books; any process that maps the region reads
any slot with plain memory copies, checking key, generation and checksums (see
:mod:`pof_connector.tiers.base`).

**Writers trade slots**, so a busy writer is not held to its share while another's pages sit
unused: that is what pooling memory means. A partition starts as a contiguous run of slots. A
writer that must evict to store counts it in its trade record, with how long the evicted page
had gone unused. Each writer, on its heartbeat (:meth:`CxlTier.balance`), looks at the others'
records: when one evicted within :data:`TRADE_SHORT_S`, and its own coldest page has gone unused
:data:`TRADE_RATIO` times longer (and at least :data:`TRADE_MIN_UNUSED_S`), it gives that writer
slots: free ones first, then its coldest pages' (evicted and withdrawn like any eviction). A
slot changes hands only by its current owner, in this order: out of its books, generation bumped
and live generation zeroed (no reader accepts the old page), then the owner table names the new
writer, then the giver's count of slots given grows; the taker sees the count change and adopts
the slots it now owns (:meth:`CxlTier.adopt_given`). No slot ever has two writers, and a reader
still following the old page's index entry misses, as after any eviction. A writer keeps at
least a quarter of its first share. A writer with ``tiers.cxl.trade: false`` neither asks nor
gives, and regions of version 1 (no owner table) keep fixed partitions.
The records hold counts and durations, no clock readings, so writers on several hosts that share
one device can compare them too.

A partition is claimed with an advisory lock on one byte of the region file or device itself
(``partition: auto``), so every process of the host contends for the same claim whatever path or
runtime directory it uses; or it is named explicitly when several hosts share one CXL device
(locks do not cross hosts; give each host its own partition number).

Production: point ``path`` at the devdax device of the CXL memory (``/dev/dax0.0``, created
with ``daxctl reconfigure-device --mode=devdax``); ``size`` must be a multiple of the device
alignment (2 MiB) and at most the device size. Such memory is already local to its CXL node, so
no NUMA binding is needed. When CXL memory is onlined as system RAM instead (``--mode=system-ram``,
a CPU-less NUMA node), use a file on a tmpfs/hugetlbfs mount and set ``numa_node`` to that node:
pof binds the mapping there with libnuma. Tests use a file under /dev/shm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
import uuid
from collections.abc import Sequence

import numpy as np

from pof_connector.config import ConfigError, TierConfig, format_size
from pof_connector.pages.keys import PageKey
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers.base import SlotRef, Tier, slot_bytes_for

log = logging.getLogger(__name__)

MAGIC = b"POFCXL01"
VERSION = 2
VERSIONS = (1, 2)
"""Region versions this code maps: 1 without the owner table (fixed partitions), 2 with it."""
SUPERBLOCK_BYTES = 4096
_SUPER = struct.Struct("<8sIIQQQQ16s")   # magic version partitions slot_bytes num_slots gens_at data_at uuid
TRADES_AT = 1024
TRADE_FIELDS = 4
TRADE_PARTITIONS = (SUPERBLOCK_BYTES - TRADES_AT) // (8 * TRADE_FIELDS)
"""Most partitions whose writers trade slots (a region with more keeps fixed partitions)."""
TRADE_RATIO = 2.0
"""A writer gives slots when its coldest page has gone unused this many times longer than the
page the taker last evicted."""
TRADE_MIN_UNUSED_S = 1.0
"""A page used within this many seconds is never given away."""
TRADE_SHORT_S = 5.0
"""A writer that evicted within this many seconds (by the balancer's clock) is short of room."""
TRADE_STEPS = 16
"""One balance gives at most this fraction (1/TRADE_STEPS) of the writer's first share."""
TRADE_FLOOR = 4
"""A writer keeps at least 1/TRADE_FLOOR of its first share."""


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class CxlTier(Tier):
    medium = "cxl"

    def __init__(self, spec: PageSpec, config: TierConfig, runtime_dir: str) -> None:
        assert config.path is not None
        self.path = config.path
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock_fd: int | None = fd         # kept open: it holds our partition's claim
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)     # one process formats a new region at a time
            st = os.fstat(fd)
            self._identity = (st.st_dev, st.st_ino)
            is_device = stat.S_ISCHR(st.st_mode)
            if not is_device and st.st_size == 0:
                os.ftruncate(fd, config.size)
            size = config.size if is_device else os.fstat(fd).st_size
            if size != config.size:
                log.warning("cxl: %s already has %s, configured tiers.cxl.size=%s; using the existing size",
                            self.path, format_size(size), format_size(config.size))
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            geometry = _SUPER.unpack_from(self._mm, 0)
            if geometry[0] != MAGIC:
                geometry = self._format(spec, config, size)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            self._release_fd()
            raise
        _, version, partitions, slot_bytes, num_slots, gens_at, data_at, region_id = geometry
        try:
            if version not in VERSIONS:
                raise ConfigError(f"tiers.cxl.path: {self.path} holds a region of version {version}, this pof maps "
                                  f"versions {', '.join(map(str, VERSIONS))}; allowed: a new path (or remove it)")
            if slot_bytes < spec.page_bytes:
                raise ConfigError(f"tiers.cxl.path: the region {self.path} has {slot_bytes}-byte slots, too small "
                                  f"for this model's {spec.page_bytes}-byte pages; use another path for this model")
            if partitions != config.partitions:
                raise ConfigError(f"tiers.cxl.partitions: {self.path} was formatted with {partitions} partitions, "
                                  f"configured {config.partitions}; allowed: {partitions} (or a new path)")
            self.partition = _claim_partition(fd, partitions, config.partition, self.path)
        except BaseException:
            self._mm.close()
            self._release_fd()
            raise
        self.region_id = uuid.UUID(bytes=region_id)
        region = np.frombuffer(self._mm, dtype=np.uint8, count=num_slots * slot_bytes, offset=data_at)
        generations = np.frombuffer(self._mm, dtype=np.uint64, count=num_slots, offset=gens_at)
        per = num_slots // partitions
        self.first_share = per
        self._owners: np.ndarray | None = None
        self._trades: np.ndarray | None = None
        own: Sequence[int] = range(self.partition * per, (self.partition + 1) * per)
        self._trading = config.trade
        if version >= 2 and partitions <= TRADE_PARTITIONS:
            self._owners = np.frombuffer(self._mm, dtype=np.uint16, count=num_slots, offset=gens_at + 8 * num_slots)
            self._trades = np.frombuffer(self._mm, dtype=np.uint64, count=partitions * TRADE_FIELDS,
                                         offset=TRADES_AT).reshape(partitions, TRADE_FIELDS)
            own = [int(s) for s in np.flatnonzero(self._owners == self.partition)]
        self._owned = set(own)
        self._given_seen: tuple[int, ...] = () if self._trades is None else tuple(self._trades[:, 2].tolist())
        self._evictions_seen: list[int] = [] if self._trades is None else self._trades[:, 0].tolist()
        self._evicted_at: dict[int, float] = {}     # partition -> when its eviction count last moved
        super().__init__(spec, region, generations, slot_bytes, own)
        if config.numa_node is not None:
            try:
                _bind_numa(region, config.numa_node, is_device)
            except BaseException:
                self.close()
                raise
        log.info("cxl tier %s: region %s, %d slots of %s, partition %d/%d (%d slots%s)", self.path,
                 self.region_id, num_slots, format_size(slot_bytes), self.partition, partitions, len(self._owned),
                 ", traded with the other writers" if self.trades else ", fixed")

    def _format(self, spec: PageSpec, config: TierConfig, size: int) -> tuple[bytes, int, int, int, int, int, int,
                                                                             bytes]:
        slot_bytes = slot_bytes_for(spec)
        # Solve for the slot count with the generation and owner tables in front of the slots.
        num_slots = (size - SUPERBLOCK_BYTES) // (slot_bytes + 10)
        data_at = _align(SUPERBLOCK_BYTES + 10 * num_slots, 4096)
        while num_slots > 0 and data_at + num_slots * slot_bytes > size:
            num_slots -= 1
            data_at = _align(SUPERBLOCK_BYTES + 10 * num_slots, 4096)
        num_slots -= num_slots % config.partitions
        if num_slots < config.partitions:
            raise ConfigError(f"tiers.cxl.size: {format_size(size)} holds fewer than one {spec.page_bytes}-byte "
                              f"page per partition ({config.partitions}); allowed: at least "
                              f"{format_size(SUPERBLOCK_BYTES + 2 * config.partitions * (slot_bytes + 8) + 4096)}")
        self._mm[TRADES_AT:data_at] = bytes(data_at - TRADES_AT)   # trade records and generations start at 0
        owners = np.frombuffer(self._mm, dtype=np.uint16, count=num_slots, offset=SUPERBLOCK_BYTES + 8 * num_slots)
        owners[:] = np.arange(num_slots, dtype=np.int64) // (num_slots // config.partitions)   # contiguous shares
        del owners          # a view of the mapping: close() must not find it
        geometry = (MAGIC, VERSION, config.partitions, slot_bytes, num_slots, SUPERBLOCK_BYTES, data_at,
                    uuid.uuid4().bytes)
        _SUPER.pack_into(self._mm, 0, *geometry)
        self._mm.flush()
        log.info("cxl: formatted %s (%s) for %d slots", self.path, format_size(size), num_slots)
        return geometry

    @property
    def domain(self) -> str:
        return f"cxl:{self.region_id}"

    # ---- slots traded between writers (see the module's docstring) --------------------------

    @property
    def trades(self) -> bool:
        """Whether this writer trades slots: ``tiers.cxl.trade`` (on by default) in a region of
        version 2 with at most TRADE_PARTITIONS partitions."""
        return self._trades is not None and self._trading

    def evicted(self, unused_for: float | None) -> None:
        # A writer that does not trade never asks: slots given to it would lie unused.
        if self._trades is not None and self._trading:
            record = self._trades[self.partition]
            record[1] = int((unused_for or 0.0) * 1e9)     # the age first: a count read after it is never ahead
            record[0] = int(record[0]) + 1

    def balance(self, now: float | None = None) -> tuple[int, int, list[tuple[PageKey, SlotRef]]]:
        """Give slots to the writer shortest of room, if one evicted lately and
        this writer's coldest page has gone unused long enough (see the module's docstring).
        Returns the taker's partition (-1: none), the slots given and where each page dropped for
        them was (the caller withdraws those from the index)."""
        if self._trades is None or self._owners is None or not self._trading:
            return -1, 0, []
        now = time.monotonic() if now is None else now
        counts = self._trades[:, 0].tolist()
        ages = self._trades[:, 1].tolist()
        for q, (count, seen) in enumerate(zip(counts, self._evictions_seen, strict=True)):
            if count != seen:
                self._evicted_at[q] = now
        self._evictions_seen = counts
        hungry = [q for q, at in self._evicted_at.items() if q != self.partition and now - at <= TRADE_SHORT_S]
        if not hungry:
            return -1, 0, []
        taker = min(hungry, key=lambda q: ages[q])         # the one evicting the most recently used pages
        unused_for = max(TRADE_RATIO * ages[taker] / 1e9, TRADE_MIN_UNUSED_S)
        coldest = self.coldest_age(now)
        room = self.capacity_slots - max(1, self.first_share // TRADE_FLOOR)
        if coldest is None or coldest < unused_for or room <= 0:
            return taker, 0, []
        slots, dropped = self.give_slots(min(room, max(1, self.first_share // TRADE_STEPS)), unused_for, now)
        if slots:
            self._owned.difference_update(slots)
            self._owners[slots] = taker                   # after they were invalidated (give_slots)
            mine = self._trades[self.partition]
            mine[2] = int(mine[2]) + len(slots)           # last: the taker rescans when it changes
        return taker, len(slots), dropped

    def adopt_given(self) -> int:
        """Take in the slots other writers gave this one since the last call; returns how many."""
        if self._trades is None or self._owners is None or not self._trading:
            return 0
        given = tuple(self._trades[:, 2].tolist())
        if given == self._given_seen:
            return 0
        self._given_seen = given
        new = [int(s) for s in np.flatnonzero(self._owners == self.partition) if int(s) not in self._owned]
        self._owned.update(new)
        return self.adopt_slots(new)

    def healthy(self) -> bool:
        """The path still names the region we mapped (not removed, not replaced by a new file)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def _release_fd(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)      # drops our partition's claim
            self._lock_fd = None

    def close(self) -> None:
        self._release_fd()
        self._region = np.empty(0, dtype=np.uint8)
        self._generations = np.empty(0, dtype=np.uint64)
        self._owners = self._trades = None
        self._bytes = self._words = self._segments = None    # views of the mapping: it closes only without them
        try:
            self._mm.close()
        except BufferError:   # a caller still holds a view; the mapping goes with it
            pass


PARTITION_LOCK_AT = 1 << 20
"""Byte ``PARTITION_LOCK_AT + p`` of the region is locked by partition ``p``'s writer (a lock
range, not data: it may lie past the end of the file)."""


def _claim_partition(fd: int, partitions: int, wanted: int | None, path: str) -> int:
    """Lock a partition for this writer: an open-file-description lock (``F_OFD_SETLK``) on a
    byte of the region itself, held through ``fd``. It names the region's inode, so writers that
    reach it through other paths or with other runtime_dirs contend for it too (two writers in
    one partition would overwrite each other's pages); unlike ``lockf`` it is not shared by the
    process's other descriptors, and it ends when ``fd`` is closed, by us or by our exit."""
    candidates = range(partitions) if wanted is None else [wanted]
    for p in candidates:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, PARTITION_LOCK_AT + p))
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"tiers.cxl.path: cannot lock a partition of {path}: {e}") from None
            continue
        return p
    if wanted is None:
        raise ConfigError(f"tiers.cxl.partition: all {partitions} partitions of {path} are owned by running "
                          f"processes; allowed: raise tiers.cxl.partitions for a new region")
    raise ConfigError(f"tiers.cxl.partition: partition {wanted} of {path} is owned by another process on this "
                      f"host; allowed: 'auto' or a free partition 0..{partitions - 1}")


def _flock(kind: int, start: int) -> bytes:
    """A ``struct flock`` for one byte at ``start`` (``l_pid`` 0, as OFD locks require)."""
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)


def _bind_numa(region: np.ndarray, node: int, is_device: bool) -> None:
    if is_device:
        log.info("cxl: numa_node ignored for a devdax device (its memory is already on its node)")
        return
    name = ctypes.util.find_library("numa")
    if name is None:
        raise ConfigError("tiers.cxl.numa_node needs libnuma (apt install libnuma1); allowed: unset it")
    libnuma = ctypes.CDLL(name)
    if libnuma.numa_available() < 0 or node > libnuma.numa_max_node():
        raise ConfigError(f"tiers.cxl.numa_node: node {node} does not exist here; allowed: 0.."
                          f"{max(libnuma.numa_max_node(), 0)}")
    libnuma.numa_tonode_memory.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libnuma.numa_tonode_memory(ctypes.c_void_p(region.ctypes.data), ctypes.c_size_t(region.nbytes), node)
