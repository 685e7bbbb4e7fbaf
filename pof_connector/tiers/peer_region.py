"""The shared byte region behind the peer-HBM tier: one device tensor that every pof process of
a node maps, found through a small directory in the runtime directory.

Layout of ``<runtime_dir>/peer_hbm-<device tag>/`` (the tag names the physical device: a GPU's
UUID, so two processes with different ``CUDA_VISIBLE_DEVICES`` numberings still meet)::

    create.lock            serializes "who creates the region"
    owner.lock             held (flock) by the owning process for as long as the region lives
    region.json            geometry + how to map it (see below), written atomically by the owner
    generations-<uuid>     one u64 per slot (host memory, mmap'd by everybody): the writers' books
    p<i>-<uuid>.lock       writer partition locks

The first process that finds no live owner allocates the region on its device and becomes the
owner; later processes attach. How a process attaches depends on the device:

* ``cuda:N``: the owner allocates a device tensor and publishes its CUDA IPC handle (the numbers
  ``torch.UntypedStorage._share_cuda_()`` returns — what ``torch.multiprocessing`` sends through
  a pipe, here as JSON with base64, never pickle); others open it with ``_new_shared_cuda``.
  CUDA frees IPC memory when its owner exits, so the region lives as long as the owner;
* ``cpu``: the region is a file in ``/dev/shm`` mapped shared (tests and GPU-less hosts use this to
  run the same tier code on CPU tensors).

An attached process checks the owner's lock every heartbeat (:meth:`PeerRegion.alive`): once the
owner is gone the tier is dropped and engines recompute its pages (like a lost CXL region).

Where the region lives is checked here too: :func:`resolve_device` (``tiers.peer_hbm.device``), and
torch is imported only when a region is wanted (:func:`import_torch`).
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import mmap
import os
import uuid
from typing import Any

import numpy as np

from pof_connector.config import ConfigError, TierConfig, format_size
from pof_connector.runtime_dir import private_dir

log = logging.getLogger(__name__)

_OWNED: dict[str, Any] = {}
"""Region uuid → device tensor, for regions this process owns: CUDA refuses to open an IPC handle
in the process that exported it, so a second tier of the owner process reuses the tensor."""


def import_torch() -> Any:
    """torch, or a :class:`ConfigError` naming the key that needs it."""
    try:
        import torch
    except ImportError as e:
        raise ConfigError(f"tiers.peer_hbm: needs PyTorch, which is not importable here ({e}); install torch in "
                          f"this environment (vLLM and SGLang ship it); allowed: remove tiers.peer_hbm") from None
    return torch


def resolve_device(torch: Any, name: str) -> Any:
    """The torch device of ``tiers.peer_hbm.device``; a :class:`ConfigError` when it does not exist."""
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"tiers.peer_hbm.device: {name!r} but CUDA is not available in this process; "
                          f"allowed: 'cpu'")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ConfigError(f"tiers.peer_hbm.device: {name!r} but this process sees {count} GPU(s); "
                          f"allowed: cuda:0..cuda:{count - 1} or 'cpu'")
    return torch.device("cuda", index)


def _b64(v: bytes | None) -> str | None:
    return None if v is None else base64.b64encode(v).decode("ascii")


def _unb64(v: str | None) -> bytes | None:
    return None if v is None else base64.b64decode(v)


def device_tag(torch: Any, device: Any) -> str:
    """A name of the physical device, equal in every process of the host."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    gpu = getattr(props, "uuid", None)
    return f"cuda-{gpu}" if gpu is not None else f"cuda{device.index}"


class PeerRegion:
    """Create or attach the region of ``config`` (``tiers.peer_hbm``) for ``slot_bytes`` slots.

    Attributes after construction: ``tensor`` (1-D uint8 on the device), ``generations`` (host
    u64 per slot), ``num_slots``, ``slot_bytes``, ``region_id``, ``owner`` (this process created
    it), ``partition`` and ``own`` (the slots this process may write).
    """

    def __init__(self, torch: Any, device: Any, config: TierConfig, runtime_dir: str, slot_bytes: int,
                 page_bytes: int) -> None:
        self._torch = torch
        self.device = device
        self.tensor: Any = None
        self.generations = np.empty(0, dtype=np.uint64)
        self.dir = os.path.join(private_dir(runtime_dir), f"peer_hbm-{device_tag(torch, device)}")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._owner_fd: int | None = None
        self._lock_fd: int | None = None
        self._data_path: str | None = None
        self._mm: list[mmap.mmap] = []
        create_fd = os.open(os.path.join(self.dir, "create.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(create_fd, fcntl.LOCK_EX)
            owner_fd = os.open(os.path.join(self.dir, "owner.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(owner_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(owner_fd)
                desc = self._attach(config, page_bytes)
            else:
                self._owner_fd = owner_fd
                desc = self._create(config, slot_bytes)
        finally:
            os.close(create_fd)     # closing drops the create lock
        self.region_id = str(desc["uuid"])
        self.slot_bytes = int(desc["slot_bytes"])
        self.num_slots = int(desc["num_slots"])
        partitions = int(desc["partitions"])
        self.partition = self._claim_partition(partitions, config.partition)
        per = self.num_slots // partitions
        self.own = range(self.partition * per, (self.partition + 1) * per)
        log.info("peer_hbm %s: region %s (%s), %d slots of %s, %s, partition %d/%d", device, self.region_id,
                 "owner" if self.owner else "attached", self.num_slots, format_size(self.slot_bytes),
                 format_size(self.num_slots * self.slot_bytes), self.partition, partitions)

    @property
    def owner(self) -> bool:
        return self._owner_fd is not None

    # ---- create / attach -----------------------------------------------------------------------

    def _create(self, config: TierConfig, slot_bytes: int) -> dict[str, Any]:
        torch = self._torch
        num_slots = config.size // slot_bytes
        num_slots -= num_slots % config.partitions
        if num_slots < config.partitions:
            self._release_owner()
            raise ConfigError(f"tiers.peer_hbm.size: {format_size(config.size)} holds fewer than one "
                              f"{format_size(slot_bytes)} page per partition ({config.partitions}); allowed: at "
                              f"least {format_size(slot_bytes * config.partitions)}")
        self._remove_leftovers()
        region_id = uuid.uuid4().hex
        nbytes = num_slots * slot_bytes
        desc: dict[str, Any] = {"uuid": region_id, "slot_bytes": slot_bytes, "num_slots": num_slots,
                                "partitions": config.partitions, "owner_pid": os.getpid(),
                                "device": str(self.device)}
        try:
            self.generations = self._map_generations(region_id, num_slots, create=True)
            if self.device.type == "cuda":
                try:
                    self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
                except RuntimeError as e:     # out of memory: a configuration problem, say which key
                    raise ConfigError(f"tiers.peer_hbm.size: could not allocate {format_size(nbytes)} on "
                                      f"{self.device}: {e}; allowed: a size that fits the device") from None
                try:
                    share = self.tensor.untyped_storage()._share_cuda_()
                except RuntimeError as e:   # e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments on old torch
                    raise ConfigError(f"tiers.peer_hbm.device: the region on {self.device} cannot be shared "
                                      f"over CUDA IPC ({e}); allowed: a device whose memory torch can share, "
                                      f"or remove tiers.peer_hbm") from None
                _device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share
                desc["cuda_ipc"] = {"handle": _b64(handle), "size": int(size), "offset": int(offset),
                                    "ref_counter_handle": _b64(rc_handle), "ref_counter_offset": int(rc_offset),
                                    "event_handle": _b64(ev_handle), "event_sync_required": bool(ev_sync)}
            else:
                shm = "/dev/shm" if os.path.isdir("/dev/shm") else self.dir
                self._data_path = os.path.join(shm, f"pof-peer_hbm-{region_id}")
                self.tensor = self._map_file(self._data_path, nbytes, create=True)
                desc["path"] = self._data_path
            _OWNED[region_id] = self.tensor
            tmp = os.path.join(self.dir, f"region.json.{os.getpid()}")
            with open(tmp, "w") as f:
                json.dump(desc, f)
            os.replace(tmp, os.path.join(self.dir, "region.json"))    # readers never see half a file
        except BaseException:
            self.close()
            raise
        return desc

    def _remove_leftovers(self) -> None:
        """Files of a region whose owner died without closing it (processes still attached to it
        keep their mappings: unlinking does not take memory from under them)."""
        try:
            with open(os.path.join(self.dir, "region.json")) as f:
                old = json.load(f).get("path")
            if isinstance(old, str) and os.path.basename(old).startswith("pof-peer_hbm-"):
                os.unlink(old)
        except (OSError, ValueError, AttributeError):
            pass
        for name in os.listdir(self.dir):
            if name.startswith("generations-") or (name.startswith("p") and name.endswith(".lock") and "-" in name):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass

    def _attach(self, config: TierConfig, page_bytes: int) -> dict[str, Any]:
        torch = self._torch
        try:
            with open(os.path.join(self.dir, "region.json")) as f:
                desc: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"tiers.peer_hbm: a process owns the {self.device} region in {self.dir} but its "
                              f"description is unreadable ({e}); allowed: stop that process") from None
        if int(desc["slot_bytes"]) < page_bytes:
            raise ConfigError(f"tiers.peer_hbm: the {self.device} region has {desc['slot_bytes']}-byte slots, too "
                              f"small for this model's {page_bytes}-byte pages; allowed: another runtime_dir")
        if int(desc["partitions"]) != config.partitions:
            raise ConfigError(f"tiers.peer_hbm.partitions: the {self.device} region has {desc['partitions']} "
                              f"partitions, configured {config.partitions}; allowed: {desc['partitions']}")
        nbytes = int(desc["slot_bytes"]) * int(desc["num_slots"])
        wanted = config.size // int(desc["slot_bytes"])
        if int(desc["num_slots"]) != wanted - wanted % config.partitions:
            log.warning("peer_hbm: the %s region has %s, configured tiers.peer_hbm.size=%s; using the region",
                        self.device, format_size(nbytes), format_size(config.size))
        self.generations = self._map_generations(str(desc["uuid"]), int(desc["num_slots"]), create=False)
        mine = _OWNED.get(str(desc["uuid"]))
        if mine is not None and int(desc["owner_pid"]) == os.getpid():
            self.tensor = mine
        elif self.device.type == "cuda":
            # torch.multiprocessing's own consumer path: it opens the handle once per process (CUDA
            # refuses a second open) and releases the owner's reference counter when done.
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            ipc = desc["cuda_ipc"]
            shared = (self.device.index, _unb64(ipc["handle"]), ipc["size"], ipc["offset"],
                      _unb64(ipc["ref_counter_handle"]), ipc["ref_counter_offset"], _unb64(ipc["event_handle"]),
                      ipc["event_sync_required"])
            try:
                self.tensor = rebuild_cuda_tensor(torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage,
                                                  torch.uint8, *shared[:4], False, *shared[4:])
            except TypeError:     # a torch whose private signature moved: open the handle directly
                torch.cuda._lazy_init()
                storage = torch.UntypedStorage._new_shared_cuda(*shared)
                self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)[:nbytes]
        else:
            self.tensor = self._map_file(str(desc["path"]), nbytes, create=False)
        return desc

    def _map_file(self, path: str, nbytes: int, *, create: bool) -> Any:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._mm.append(mm)
        return self._torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes))

    def _map_generations(self, region_id: str, num_slots: int, *, create: bool) -> np.ndarray:
        path = os.path.join(self.dir, f"generations-{region_id}")
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, 8 * num_slots)
            mm = mmap.mmap(fd, 8 * num_slots, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._mm.append(mm)
        return np.frombuffer(mm, dtype=np.uint64, count=num_slots)

    def _claim_partition(self, partitions: int, wanted: int | None) -> int:
        candidates = range(partitions) if wanted is None else [wanted]
        for p in candidates:
            fd = os.open(os.path.join(self.dir, f"p{p}-{self.region_id}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd = fd
            return p
        self.close()
        if wanted is None:
            raise ConfigError(f"tiers.peer_hbm.partition: all {partitions} partitions of the {self.device} region "
                              f"are owned by running processes; allowed: more tiers.peer_hbm.partitions (takes "
                              f"effect when the region is created again)")
        raise ConfigError(f"tiers.peer_hbm.partition: partition {wanted} of the {self.device} region is owned by "
                          f"another process; allowed: 'auto' or a free partition 0..{partitions - 1}")

    # ---- liveness ------------------------------------------------------------------------------

    def alive(self) -> bool:
        """The region we mapped is still the live one: its owner runs and has not been replaced."""
        if self.owner:
            return True
        try:
            with open(os.path.join(self.dir, "region.json")) as f:
                if json.load(f).get("uuid") != self.region_id:
                    return False
            fd = os.open(os.path.join(self.dir, "owner.lock"), os.O_RDWR)
        except (OSError, ValueError):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True         # the owner holds its exclusive lock
        finally:
            os.close(fd)        # also drops the shared lock if we got it
        return False

    def _release_owner(self) -> None:
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None

    def close(self) -> None:
        """Unmap; the owner also removes the region's files (attached processes keep their mappings
        until they notice the owner is gone)."""
        self.tensor = None
        self.generations = np.empty(0, dtype=np.uint64)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.owner:
            region_id = getattr(self, "region_id", None)
            paths = [self._data_path, os.path.join(self.dir, "region.json")]
            if region_id is not None:
                paths.append(os.path.join(self.dir, f"generations-{region_id}"))
            for path in paths:
                if path is not None:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            _OWNED.pop(region_id or "", None)
            self._release_owner()
        for mm in self._mm:
            try:
                mm.close()
            except BufferError:      # a view is still alive; the mapping goes with it
                pass
        self._mm = []
