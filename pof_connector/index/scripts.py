"""The index's Lua scripts (one per write, so a key's record lists stay consistent), read from the
``.lua`` files beside this module (``lua/``: each says what its KEYS and ARGV are); the schema is in
:mod:`.redis` and :mod:`.summary`.

A script that uses another's functions or locals runs after it: the loader joins the files
(``HEARTBEAT`` = ``now.lua`` + ``leases.lua`` + ``heartbeat.lua``; the segment scripts = ``page_fields.lua`` +
``summary.lua`` + their own), so each file stays one piece a Lua reader can follow.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def _lua(name: str) -> str:
    return files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


NOW = _lua("now")
LEASES = _lua("leases")
HEARTBEAT = NOW + LEASES + _lua("heartbeat")
PUBLISH = _lua("publish")
WITHDRAW = _lua("withdraw")
LEAVE = LEASES + _lua("leave")
PAGE_FIELDS = _lua("page_fields")
SUMMARY = PAGE_FIELDS + _lua("summary")
SEGMENT_PUBLISH = SUMMARY + _lua("segment_publish")
SEGMENT_WITHDRAW = SUMMARY + _lua("segment_withdraw")
SEGMENT_PRUNE = SUMMARY + _lua("segment_prune")
