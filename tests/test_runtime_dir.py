"""Issue 19: the runtime directory, its sockets and region files are owner-only; a runtime
directory another user owns is refused; default binds are loopback."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pof_connector.cli import build_parser, main
from pof_connector.config import ConfigError, PofConfig, TierConfig
from pof_connector.index.embedded import SOCKET, ensure_embedded, stop_embedded
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool
from pof_connector.router.router_config import RouterConfig
from pof_connector.runtime_dir import private_dir
from pof_connector.tiers import make_tier

NOBODY = 65534


@pytest.fixture
def base() -> Iterator[Path]:
    """A short directory (unix socket paths stay under ~100 characters), world-readable on purpose."""
    d = Path(tempfile.mkdtemp(prefix="pof-rd-", dir="/tmp"))
    yield d
    stop_embedded(d / "rt")
    for p in sorted(d.rglob("*"), reverse=True):           # chowned entries are removable by root
        p.unlink() if not p.is_dir() or p.is_symlink() else p.rmdir()
    d.rmdir()


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_a_runtime_dir_owned_by_another_user_is_refused(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user (chown) needs root")
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"runtime_dir: {theirs} is owned by uid {NOBODY}"):
        private_dir(theirs)
    config = PofConfig.from_mapping({"index_url": "embedded", "runtime_dir": str(theirs),
                                     "tiers": {"cpu_dram": {"size": "1MiB"}}})
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        Pool(config, PageSpec(2, 512, 16), b"n" * 16)
    assert main(["index", "serve", "--runtime-dir", str(theirs), "--http-port", "0"]) == 1
    assert f"{theirs} is owned by uid {NOBODY}" in capsys.readouterr().err
    assert list(theirs.iterdir()) == []                       # nothing was created in it
    with pytest.raises(ConfigError, match="shared directory"):
        private_dir("/tmp")                                  # sticky and world-writable: never made 0o700


def test_runtime_dir_socket_and_regions_are_owner_only(base: Path) -> None:
    rt = base / "rt"
    rt.mkdir(mode=0o755)
    os.chmod(rt, 0o755)                                      # as an older pof (or a umask) left it
    ensure_embedded(rt, idle_s=30)
    assert mode(rt) == 0o700
    sock = rt / SOCKET
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and mode(sock) & 0o077 == 0
    assert private_dir(base / "new" / "deeper") == base / "new" / "deeper"
    assert mode(base / "new" / "deeper") == 0o700
    region = base / "region.cxl"
    tier = make_tier(TierConfig("cxl", 1 << 20, path=str(region), partitions=2),
                     PageSpec(2, 4096, 16), str(rt))
    try:
        assert mode(region) == 0o600
    finally:
        tier.close()


def test_default_binds_are_loopback() -> None:
    parser = build_parser()
    assert parser.parse_args(["index", "serve"]).http_host == "127.0.0.1"
    assert parser.parse_args(["index", "api", "--url", "redis://h:1/0"]).http_host == "127.0.0.1"
    assert RouterConfig.from_mapping({"backends": [{"name": "a", "url": "http://h:1"}]}).host == "127.0.0.1"
    with pytest.raises(SystemExit):                     # the relay binds where told, with no default
        parser.parse_args(["relay", "--config", "c.yaml", "--engine-events", "tcp://127.0.0.1:1"])
