"""A thin wrapper around one NIXL agent with a UCX backend, configured from pof's config.

It hides NIXL's import, its error types and its handle objects from the rest of pof: every NIXL
failure comes out as :class:`FabricError`, and "ERR" states count as failures too (NIXL reports
errors both ways, docs/engines/nixl-1.5.1-ucx.md §2).
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

import numpy as np

from pof_connector.config import FabricConfig
from pof_connector.fabric.nixl_api import load_nixl

log = logging.getLogger(__name__)

# UCX keepalive knobs, from the link-cut measurements (research notes §4): without all four a
# dead link is noticed after 18 s or after ~15 minutes. USER_TIMEOUT stays at 5 s because a
# congested but healthy link can hold data unacknowledged for seconds. pof's own deadline
# (fabric.timeout_s) bounds every read anyway; these only make dead connections fail for good.
UCX_ENGINE_CONFIG = ("TCP_USER_TIMEOUT=5s", "TCP_KEEPIDLE=1s", "TCP_KEEPINTVL=1s", "KEEPALIVE_INTERVAL=1s")


class FabricError(RuntimeError):
    """A fabric operation failed. ``reason`` is the :class:`~pof_connector.pages.layout.PageError` reason
    the affected pages get; ``disconnected`` means the peer's connection is dead for good."""

    def __init__(self, reason: str, detail: str, *, disconnected: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.disconnected = disconnected


def ucx_init_params(config: FabricConfig) -> dict[str, str]:
    """``create_backend("UCX", ...)`` parameters: scoped to pof's agent, so an engine's own NIXL
    agent in the same process keeps its settings (a ``UCX_*`` environment variable still wins)."""
    engine = list(UCX_ENGINE_CONFIG)
    if config.tls is not None:
        engine.insert(0, f"TLS={config.tls}")
    params = {"engine_config": ",".join(engine)}
    if config.ucx_devices is not None:
        params["ucx_devices"] = config.ucx_devices
    return params


def new_nixl_agent(name: str, config: FabricConfig) -> Any:
    """NIXL's Python agent (strict thread sync, no backend yet) with the progress-thread wake-up
    of ``config`` (see :func:`_core_agent`)."""
    api = load_nixl()
    conf = api.nixl_agent_config(backends=[], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = api.nixl_agent(name, conf)
    agent.agent = _core_agent(api, name, conf, config.progress_wakeup_ms)
    return agent


def _core_agent(api: ModuleType, name: str, conf: Any, wakeup_ms: int) -> Any:
    """The C++ agent under NIXL's Python wrapper, with the progress thread's poll timeout set.

    The wrapper (1.5.1, and NIXL's main branch) always passes ``pthrDelay = 0``, and the UCX
    backend's progress thread then calls ``poll()`` with a zero timeout in a loop: an idle agent
    burns a whole core (measured: 4.8 CPU-s in 5 s). On a CPU engine, or a 2-core host, that
    starves the engine and the owner a reader waits for (READs took 4-5 ms per round trip, and
    an engine busy with a prompt missed its index heartbeats). With a timeout the thread sleeps
    in ``poll()`` on the workers' event fds, wakes when UCX has work, and at the latest every
    ``wakeup_ms`` (0.1 CPU-s in 5 s). The wrapper's agent has no backend yet, so swapping the
    C++ agent before ``create_backend`` leaves nothing behind.
    """
    bind = sys.modules[api.__name__].nixlBind
    core = bind.nixlAgentConfig()
    core.useProgThread = True
    core.useListenThread = False
    core.listenPort = conf.port
    core.syncMode = conf.sync_mode.value
    core.pthrDelay = wakeup_ms * 1000       # microseconds; NIXL rounds up to whole milliseconds
    core.lthrDelay = 100000
    core.captureTelemetry = False
    return bind.nixlAgent(name, core)


def _wrap(err: Exception, what: str) -> FabricError:
    name = type(err).__name__
    return FabricError("remote_error", f"{what}: {name}: {err}", disconnected="Disconnect" in name)


class NixlAgent:
    """One NIXL agent of this process. Thread-safe (NIXL's strict sync mode serializes calls)."""

    def __init__(self, name: str, config: FabricConfig) -> None:
        self.name = name
        self._agent: Any = new_nixl_agent(name, config)
        try:
            self._agent.create_backend("UCX", ucx_init_params(config))
        except Exception as e:
            raise FabricError("config", f"the UCX backend did not start with {ucx_init_params(config)}: {e}") from e
        self._registered: list[Any] = []

    def register(self, region: np.ndarray) -> None:
        """Register host memory for reads (ours and peers'); it stays registered until :meth:`close`."""
        descs = np.array([[region.ctypes.data, region.nbytes, 0]], dtype=np.uint64)
        self._registered.append(self._agent.register_memory(descs, "DRAM"))

    def metadata(self) -> bytes:
        """What a peer needs to read our registered memory (call after :meth:`register`)."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as e:
            raise _wrap(e, "add_remote_agent") from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:   # already gone: nothing to undo
            log.debug("pof fabric: remove_remote_agent(%s): %s", name, e)

    def prep(self, peer: str | None, descs: np.ndarray) -> Any:
        """A prepared descriptor list: ``peer=None`` for our own memory, else the peer's name.
        ``descs`` is an Nx3 uint64 array of (address, length, device)."""
        try:
            return self._agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", np.ascontiguousarray(descs), "DRAM")
        except Exception as e:
            raise _wrap(e, "prep_xfer_dlist") from e

    def release_dlist(self, handle: Any) -> None:
        try:
            self._agent.release_dlist_handle(handle)
        except Exception as e:
            log.debug("pof fabric: release_dlist_handle: %s", e)

    def post_read(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> Any:
        """Post one READ of ``remote[remote_idx[i]]`` into ``local[local_idx[i]]``; returns its handle."""
        return self._post("READ", local, local_idx, remote, remote_idx)

    def post_write(self, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> Any:
        """Post one WRITE of ``local[local_idx[i]]`` into ``remote[remote_idx[i]]``; returns its handle."""
        return self._post("WRITE", local, local_idx, remote, remote_idx)

    def _post(self, op: str, local: Any, local_idx: np.ndarray, remote: Any, remote_idx: np.ndarray) -> Any:
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(op, local, local_idx.astype(np.int32), remote,
                                                   remote_idx.astype(np.int32))
            if self._agent.transfer(handle) == "ERR":
                raise FabricError("remote_error", "transfer posted in state ERR")
        except FabricError:
            self.release(handle)
            raise
        except Exception as e:
            self.release(handle)
            raise _wrap(e, "transfer") from e
        return handle

    def done(self, handle: Any) -> bool:
        """True when the transfer completed; raises :class:`FabricError` when it failed."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:
            raise _wrap(e, "check_xfer_state") from e
        if state == "ERR":
            raise FabricError("remote_error", "transfer ended in state ERR")
        return bool(state == "DONE")

    def release(self, handle: Any) -> None:
        """Release (and so cancel, if still in flight) a transfer. Data of a cancelled READ may still
        land later: its destination must not be reused soon (see StagingArea.quarantine)."""
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.debug("pof fabric: release_xfer_handle: %s", e)

    def send_notif(self, peer: str, message: bytes) -> None:
        """Send a small message to a connected peer (its metadata loaded with :meth:`add_peer`)."""
        try:
            self._agent.send_notif(peer, message)
        except Exception as e:
            raise _wrap(e, "send_notif") from e

    def notifs(self) -> dict[str, list[bytes]]:
        """Messages received since the last call: sender agent name → messages, oldest first."""
        try:
            got = self._agent.get_new_notifs()
        except Exception as e:
            raise _wrap(e, "get_new_notifs") from e
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}

    def close(self) -> None:
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:
                log.debug("pof fabric: deregister_memory: %s", e)
        self._registered.clear()
        self._agent = None
