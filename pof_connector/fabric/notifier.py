"""Small control messages between pool nodes, carried by NIXL notifications.

Spill needs two messages per grant (a request and its reply) and nothing else, so there is no
RPC layer: a message is one JSON object in a NIXL notification (``send_notif``), a request
carries an ``id`` and its reply carries the same ``id``. NIXL already connects the agents
(research notes §2: a notification reaches an agent that loaded the sender's metadata; the
receiver needs the sender's metadata to answer), so no port, socket or address is added.

One thread per agent polls ``get_new_notifs`` (NIXL hands each notification to one caller only,
so two pollers would steal each other's messages): requests go to the handler, replies wake
the caller waiting in :meth:`Notifier.request`.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from pof_connector.fabric.agent import FabricError, NixlAgent
from pof_connector.index.guarded import LogOnce

log = logging.getLogger(__name__)

PREFIX = b"pof-spill/1 "
"""Marks pof's messages (and their version): anything else in the agent's notifications is ignored."""
POLL_S = 0.002
"""Poll interval: a grant costs a few ms of latency; a tighter loop would take CPU from UCX."""

Message = dict[str, Any]
Handler = Callable[[str, Message], "Message | None"]
"""``(sender agent, request) → reply``, or ``None`` to send no reply (the requester times out)."""


class Notifier:
    """Sends requests and waits for their replies; hands requests to ``handler``.

    What it refuses is counted in :attr:`refused` and logged once per reason: ``malformed`` (not
    a JSON object, nested too deeply), ``forged_reply`` (a reply from an agent the request was not
    sent to; a late reply to a request given up is dropped uncounted), ``handler_error`` (a bug in
    the handler, logged with its traceback)."""

    def __init__(self, agent: NixlAgent, handler: Handler | None) -> None:
        self.agent = agent
        self._handler = handler
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[str, threading.Event, list[Message]]] = {}   # id → (peer, done, box)
        self.refused: dict[str, int] = {"malformed": 0, "forged_reply": 0, "handler_error": 0}
        self._log_once = LogOnce(log)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pof-notifier", daemon=True)
        self._thread.start()

    def request(self, peer: str, message: Message, timeout_s: float) -> Message | None:
        """Send ``message`` to agent ``peer`` (connected already) and wait for its reply;
        ``None`` when none came within ``timeout_s``. Raises :class:`FabricError` when the
        message could not even be sent (e.g. the peer's connection is dead)."""
        rid = next(self._ids)
        done, box = threading.Event(), list[Message]()
        with self._lock:
            self._waiting[rid] = (peer, done, box)
        try:
            self.agent.send_notif(peer, PREFIX + json.dumps({**message, "id": rid}).encode())
            done.wait(timeout_s)
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        return box[0] if box else None

    def send(self, peer: str, message: Message) -> None:
        """Send a message that expects no reply."""
        self.agent.send_notif(peer, PREFIX + json.dumps(message).encode())

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                got = self.agent.notifs()
            except FabricError as e:
                log.warning("pof fabric: reading notifications failed: %s", e)
                continue
            for sender, messages in got.items():
                for raw in messages:
                    try:
                        self._dispatch(sender, raw)
                    except Exception:   # a bug: show it with its traceback, keep serving the others
                        self.refused["handler_error"] += 1
                        log.exception("pof fabric: handling a control message from %s failed", sender)

    def _dispatch(self, sender: str, raw: bytes) -> None:
        if not raw.startswith(PREFIX):
            return
        try:
            message = json.loads(raw[len(PREFIX):])
        except (ValueError, RecursionError):       # not UTF-8 or JSON, or nested too deeply
            message = None
        if not isinstance(message, dict):
            self._refuse("malformed", "a malformed control message from %s", sender)
            return
        if message.get("op") == "reply":
            rid = message.get("id")
            with self._lock:
                waiter = self._waiting.get(rid) if isinstance(rid, int) else None
            if waiter is not None and waiter[0] == sender:
                waiter[2].append(message)
                waiter[1].set()
            elif waiter is not None:
                self._refuse("forged_reply", "a reply from %s to a request sent to %s", sender, waiter[0])
            return                           # else its requester gave up already
        if self._handler is None:
            return
        reply = self._handler(sender, message)
        if reply is None or "id" not in message:
            return
        try:
            self.send(sender, {**reply, "op": "reply", "id": message["id"]})
        except FabricError as e:   # the requester is gone: it times out on its side
            log.info("pof fabric: could not answer %s: %s", sender, e)

    def _refuse(self, reason: str, fmt: str, *args: object) -> None:
        self.refused[reason] += 1
        self._log_once(f"refused-{reason}", logging.WARNING, "pof fabric: refused " + fmt + ". Further ones are "
                       f"counted in refused[{reason}]", *args)

    def close(self) -> None:
        """Stop polling (before the agent closes)."""
        self._stop.set()
        self._thread.join(timeout=5)
