"""CXL memory: an mmap of a devdax device or a file, shared by several processes.

Region layout::

    [0, 4096)            superblock: magic, version, partitions, slot_bytes, num_slots,
                         offsets, region uuid
    [4096, data_offset)  generation table: one u64 per slot
    [data_offset, ...)   num_slots slots of slot_bytes

Each writer owns one partition (a contiguous run of slots) and keeps its own books; any process
that maps the region reads any slot with plain memory copies, checking key, generation and
checksums (see :mod:`pof_connector.tiers.base`). A partition is claimed with an advisory lock
on one byte of the region file or device itself (``partition: auto``), so every process of the
host contends for the same claim whatever path or runtime directory it uses; or it is named
explicitly when several hosts share one CXL device (locks do not cross hosts; give each host its
own partition number).

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
import uuid

import numpy as np

from pof_connector.config import ConfigError, TierConfig, format_size
from pof_connector.pages.layout import PageSpec
from pof_connector.tiers.base import Tier, slot_bytes_for

log = logging.getLogger(__name__)

MAGIC = b"POFCXL01"
VERSION = 1
SUPERBLOCK_BYTES = 4096
_SUPER = struct.Struct("<8sIIQQQQ16s")   # magic version partitions slot_bytes num_slots gens_at data_at uuid


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
        _, _, partitions, slot_bytes, num_slots, gens_at, data_at, region_id = geometry
        try:
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
        own = range(self.partition * per, (self.partition + 1) * per)
        super().__init__(spec, region, generations, slot_bytes, own)
        if config.numa_node is not None:
            try:
                _bind_numa(region, config.numa_node, is_device)
            except BaseException:
                self.close()
                raise
        log.info("cxl tier %s: region %s, %d slots of %s, partition %d/%d (%d slots)", self.path,
                 self.region_id, num_slots, format_size(slot_bytes), self.partition, partitions, per)

    def _format(self, spec: PageSpec, config: TierConfig, size: int) -> tuple[bytes, int, int, int, int, int, int,
                                                                             bytes]:
        slot_bytes = slot_bytes_for(spec)
        # Solve for the slot count with the generation table in front of the slots.
        num_slots = (size - SUPERBLOCK_BYTES) // (slot_bytes + 8)
        data_at = _align(SUPERBLOCK_BYTES + 8 * num_slots, 4096)
        while num_slots > 0 and data_at + num_slots * slot_bytes > size:
            num_slots -= 1
            data_at = _align(SUPERBLOCK_BYTES + 8 * num_slots, 4096)
        num_slots -= num_slots % config.partitions
        if num_slots < config.partitions:
            raise ConfigError(f"tiers.cxl.size: {format_size(size)} holds fewer than one {spec.page_bytes}-byte "
                              f"page per partition ({config.partitions}); allowed: at least "
                              f"{format_size(SUPERBLOCK_BYTES + 2 * config.partitions * (slot_bytes + 8) + 4096)}")
        self._mm[SUPERBLOCK_BYTES:data_at] = bytes(data_at - SUPERBLOCK_BYTES)   # generations start at 0
        geometry = (MAGIC, VERSION, config.partitions, slot_bytes, num_slots, SUPERBLOCK_BYTES, data_at,
                    uuid.uuid4().bytes)
        _SUPER.pack_into(self._mm, 0, *geometry)
        self._mm.flush()
        log.info("cxl: formatted %s (%s) for %d slots", self.path, format_size(size), num_slots)
        return geometry

    @property
    def domain(self) -> str:
        return f"cxl:{self.region_id}"

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
