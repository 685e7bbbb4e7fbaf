# The native decoders of pof_connector.index.record_runs and .segments (built from _prefix_runs.c when a C compiler
# is there).
from typing import TypeVar

from typing_extensions import Buffer

T = TypeVar("T")

def leading_runs(values: list[bytes | None], alive: bytes, n_media: int, /
                 ) -> tuple[int, int, int, list[int], list[tuple[bytearray, bytearray, bytearray]]]: ...
def summary_runs(values: list[bytes | None], first_page: Buffer, tags: Buffer, alive: Buffer, n_media: int,
                 segment_pages: int, /
                 ) -> tuple[int, int, int, bytes, tuple[bytes, bytes, bytes, bytes], bytes, bytes]:
    """The runs and holders of a segment lookup's reply, as ``summary.summary_runs`` gives them in Python:
    ``values`` one summary per segment field, ``first_page`` (int64) each segment's query page at its
    offset 0, ``tags`` (uint64) each query page's tag, ``alive`` the live incarnations (sorted uint32).
    Returns held, malformed, unknown, heads (uint32s), the heads' runs' media as ``summary.MediaRuns``,
    per query page the layer of its tag (255: none), and the marked query pages (int64)."""
    ...
def record_slots(values: list[bytes | None], segments: Buffer, base: int, media: Buffer, layers: Buffer,
                 slots: Buffer, gens: Buffer, /) -> None:
    """A holder's slots and generations from its records, written into ``slots`` and ``gens`` (int64s)
    for the pages whose generation is negative: see ``summary.record_slots``."""
    ...
def slot_objects(cls: type[T], names: tuple[str, ...], values: tuple[object, ...], /) -> list[T]:
    """New instances of ``cls`` made without calling it, slot ``names[j]`` of instance ``i`` set to
    ``values[j][i]`` where ``values[j]`` is a list, else to ``values[j]`` (``PrefixMatch.from_source``)."""
    ...
