"""Two pool nodes sharing one CXL region on a real Redis-protocol index, node a holding a prefix,
and `pof router` in front of backends named after them: the set-up of the router tests that weigh
a prefix's holder against a node that loads it from the pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from pof_connector.pool import Pool
from pof_connector.router.router import Router
from pof_connector.router.router_config import RouterConfig
from pof_connector.router.serve import build
from tests.locality.test_api import node

SEG = [np.zeros(512, np.uint8)] * 2


@contextmanager
def pool_pair(index_url: str, runtime_dir: str, shm_path: str, prefix: list[int],
              timeout_s: float) -> Iterator[tuple[Router, Pool, Pool]]:
    """(router, a, b) once the router sees a's pages of ``prefix`` (within ``timeout_s``)."""
    cxl = {"path": shm_path, "size": "1MiB", "partitions": 2}
    a = node("a", index_url, runtime_dir, cxl=cxl)
    b = node("b", index_url, runtime_dir, cxl=cxl)
    a.store([(k, SEG) for k in a.keys_for(prefix)]).result()
    cfg = RouterConfig.from_mapping({"index_url": index_url,
                                     "backends": [{"name": "a", "url": "http://127.0.0.1:1"},
                                                  {"name": "b", "url": "http://127.0.0.1:2"}]})
    router, index = build(cfg)
    try:
        deadline = time.monotonic() + timeout_s
        while router.choose([*prefix, 1]).route != "prefix-holder":     # until a's pages are in the index
            assert time.monotonic() < deadline, "a's pages never reached the index"
            time.sleep(0.05)
        yield router, a, b
    finally:
        assert index is not None
        index.close()
        a.close()
        b.close()
