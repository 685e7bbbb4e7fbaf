"""The ``pof`` command, called in-process through ``main(argv)`` (``serve`` runs as a subprocess)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pof_connector.cli import main
from pof_connector.config import ConfigError, PofConfig, redact_url
from pof_connector.index.base import IndexUnavailable, NodeInfo, TierUsage
from pof_connector.index.redis import RedisIndex
from pof_connector.index.server import RedisServer, ping
from pof_connector.pages.layout import PageSpec
from pof_connector.pool import Pool


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A private directory with a short path: unix socket paths must stay under ~100 characters."""
    d = tempfile.mkdtemp(prefix="pof-cli-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(short_dir: Path) -> Iterator[RedisServer]:
    srv = RedisServer(short_dir / "redis").start()
    try:
        yield srv
    finally:
        srv.stop()


def _json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """stdout must be exactly one JSON object (progress goes to stderr)."""
    out = capsys.readouterr().out
    obj = json.loads(out)
    assert isinstance(obj, dict)
    return obj


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("index", "stats", "bench"):
        assert command in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["bench"]) == 2
    assert main(["bench", "tiers", "--sizes", "lots"]) == 2
    assert "usage" in capsys.readouterr().err


def test_bench_tiers_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--json", "--sizes", "64KiB", "--tier-size", "8MiB", "--repeat", "1"]) == 0
    result = _json(capsys)
    assert result["bench"] == "tiers"
    ratio = result["ratio"]
    assert isinstance(ratio, float) and ratio > 0
    assert isinstance(result["min_ratio"], float) and 0 < result["min_ratio"] <= ratio
    rows = result["rows"]
    assert isinstance(rows, list)
    assert sorted(r["medium"] for r in rows) == ["cpu_dram", "cxl"]
    for row in rows:
        assert row["page_bytes"] == 64 << 10
        assert row["pages_put"] == 2 * row["slots"] and row["pages_got"] == row["slots"]
        assert row["ours_gbps"] > 0 and row["memcpy_gbps"] > 0
    assert "numpy.copyto" in str(result["baseline"])


def test_bench_tiers_rejects_unknown_medium(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--media", "tape", "--sizes", "64KiB", "--tier-size", "8MiB"]) == 1
    assert "tape" in capsys.readouterr().err


def test_bench_index_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", "--json", "--pages", "200", "--iterations", "20", "--memory-pages", "2000"]) == 0
    result = _json(capsys)
    assert result["bench"] == "index"
    for field in ("ratio", "lookup_p50_ms", "lookup_p90_ms", "lookup_p99_ms", "rtt_p50_ms",
                  "bytes_per_location", "publish_pages_per_s"):
        value = result[field]
        assert isinstance(value, (int, float)) and value > 0, field
    assert result["pages"] == 200 and result["nodes"] == 4
    assert result["round_trips_per_lookup"] == 1
    assert result["segments_per_lookup"] == 13              # 200 pages, 16 to a segment's field
    assert result["lookup_p50_ms"] <= result["lookup_p99_ms"]
    # The server's own time in the lookup bounds the ratio from below.
    assert result["server_hmget_ms"] > 0
    floor = (result["rtt_p50_ms"] + result["server_hmget_ms"]) / result["rtt_p50_ms"]
    assert result["ratio_floor"] > 1 and abs(result["ratio_floor"] - floor) < 0.01 * floor
    # Both decoders of the reply timed on it; the lookups used the native one where it was built.
    assert result["decoder"] in ("native", "numpy") and result["decode_ms"]["numpy"] > 0
    if result["decoder"] == "native":
        assert result["decode_ms"]["native"] > 0


def test_bench_index_on_given_server_leaves_it_clean(server: RedisServer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", "--json", "--pages", "40", "--iterations", "3", "--memory-pages", "100",
                 "--url", server.url]) == 0
    assert _json(capsys)["server"] == server.url
    reader = RedisIndex(server.url, None)
    try:
        assert reader.stats()["locations"] == 0
        assert reader.nodes() == []
    finally:
        reader.close()


def test_index_stats_shows_a_heartbeated_node(server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    node = RedisIndex(server.url, "node-a")
    try:
        node.heartbeat(NodeInfo("node-a", {"cpu_dram": TierUsage(1 << 30, 1 << 28, "dram:test")}), ttl_s=30)
        assert main(["index", "stats", "--url", server.url]) == 0
        out = capsys.readouterr().out
        assert "node-a" in out and "cpu_dram" in out and "1GiB" in out
        assert main(["stats", "--url", server.url, "--json"]) == 0
        result = _json(capsys)
    finally:
        node.close()
    nodes = result["nodes"]
    assert isinstance(nodes, list) and [n["node_id"] for n in nodes] == ["node-a"]
    assert nodes[0]["tiers"]["cpu_dram"]["used_bytes"] == (1 << 30) - (1 << 28)
    assert result["totals"] == {"locations": 0, "memory_bytes": result["totals"]["memory_bytes"],
                                "nodes": 1}


def test_stats_shows_a_memory_node_and_its_lent_slots(server: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    node = RedisIndex(server.url, "mem-1")
    try:
        node.heartbeat(NodeInfo("mem-1", {"cpu_dram": TierUsage(1 << 30, 1 << 29, "dram:m")},
                                {"pof.role": "memory", "fabric.lent": '{"cpu_dram":[1024,3]}'}), ttl_s=30)
        assert main(["stats", "--url", server.url]) == 0
        out = capsys.readouterr().out
        assert "mem-1 (memory)" in out and "1,024 / 3" in out
        assert main(["stats", "--url", server.url, "--json"]) == 0
        (result,) = _json(capsys)["nodes"]  # type: ignore[misc]
    finally:
        node.close()
    assert result["role"] == "memory"
    assert result["tiers"]["cpu_dram"]["lent_slots"] == 1024 and result["tiers"]["cpu_dram"]["lease_writers"] == 3


def test_stats_table_keeps_its_columns_when_piped(server: RedisServer, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``tee`` or in a CI log stdout is no terminal: rich would fit the table into 80
    columns and cut headers and cells."""
    monkeypatch.delenv("COLUMNS", raising=False)
    node = RedisIndex(server.url, "memory-node-with-a-long-name")
    try:
        node.heartbeat(NodeInfo("memory-node-with-a-long-name",
                                {"cpu_dram": TierUsage(1 << 40, 1 << 39, "dram:memory-node-with-a-long-name")},
                                {"pof.role": "memory", "fabric.lent": '{"cpu_dram":[1048576,12]}'}), ttl_s=30)
        assert main(["stats", "--url", server.url]) == 0
        out = capsys.readouterr().out
    finally:
        node.close()
    assert "…" not in out, out
    for text in ("node", "tier", "capacity", "used", "free", "lent (slots / writers)", "domain",
                 "memory-node-with-a-long-name (memory)", "1,048,576 / 12", "dram:memory-node-with-a-long-name"):
        assert text in out, (text, out)


def test_memd_needs_the_fabric(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = short_dir / "mem.yaml"
    config.write_text("index_url: local\n")
    assert main(["memd", "--config", str(config), "--slot-size", "64KiB"]) == 1
    assert "fabric.enabled" in capsys.readouterr().err


def test_index_stats_does_not_start_a_server(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = short_dir / "pof.yaml"
    config.write_text(f"runtime_dir: {short_dir / 'rt'}\n")
    assert main(["index", "stats", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "no index server running" in err
    # What to do about it, and why the quickstart's index is not there any more.
    assert f"pof index serve --config {config}" in err and "quickstart" in err, err
    assert not (short_dir / "rt").exists()


def test_serve_then_stop(short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runtime_dir = short_dir / "rt"
    url = f"unix://{runtime_dir / 'index.sock'}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pof_connector.cli", "index", "serve", "--runtime-dir",
                             str(runtime_dir), "--http-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ping(url) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert ping(url), "pof index serve did not bring a server up"
        health = None
        while health is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    health = json.loads(r.read())
            except OSError:
                time.sleep(0.1)
        assert health == {"ok": True, "nodes": 0}          # the locality API serves the same index
        # no waiting for the pidfile here: `pof index stop` must cope with a server that just came up
        assert main(["index", "serve", "--runtime-dir", str(runtime_dir)]) == 1   # one server per directory
        assert "already answers" in capsys.readouterr().err
        assert main(["index", "stop", "--runtime-dir", str(runtime_dir)]) == 0
        assert proc.wait(timeout=15) == 0
        out, _ = proc.communicate()
        assert url in out
        assert not ping(url)
        assert main(["index", "stop", "--runtime-dir", str(runtime_dir)]) == 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=15)


def test_bench_hbm_without_torch_says_where_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import torch  # noqa: F401
        pytest.skip("torch is installed here (tests/tiers/test_peer_hbm.py runs the bench)")
    except ImportError:
        pass
    assert main(["bench", "hbm", "--json"]) == 1
    assert "PyTorch is not installed" in capsys.readouterr().err


def test_an_index_password_never_appears_in_errors_logs_or_tables(runtime_dir: str, capsys: pytest.CaptureFixture[str],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Issue 19: secrets never appear in logs, `pof stats` or error messages. A Redis URL carries
    its password (``redis://user:PASSWORD@host``); every place that shows the URL redacts it."""
    secret = "s3cret-pw"
    url = f"redis://pof:{secret}@127.0.0.1:1/0"          # nothing listens on port 1: every call fails
    assert redact_url(url) == "redis://pof:***@127.0.0.1:1/0"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
    with pytest.raises(IndexUnavailable) as failed:
        RedisIndex(url, None, timeout_s=0.2).nodes()
    assert secret not in str(failed.value) and "pof:***@" in str(failed.value)
    with pytest.raises(ConfigError) as bad:
        PofConfig.from_mapping({"index_url": f"http://pof:{secret}@host"})
    assert secret not in str(bad.value)
    assert main(["stats", "--url", url]) == 1
    out = capsys.readouterr()
    assert secret not in out.err + out.out and "pof:***@" in out.err
    pool = Pool(PofConfig.from_mapping({"node_id": "n", "index_url": url, "runtime_dir": runtime_dir,
                                        "index_timeout_s": 0.2, "tiers": {"cpu_dram": {"size": "1MiB"}}}),
                PageSpec(2, 512, 16), b"n" * 16)
    try:
        pool.lookup(pool.keys_for(list(range(32))))
    finally:
        pool.close()
    assert "locality index unavailable" in caplog.text and secret not in caplog.text


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_a_bench_and_the_server_it_started() -> None:
    """``kill`` of a running bench: its index server goes with it (it was left running before, and
    so were a capacity bench's vLLM servers), and the exit code says SIGTERM (128 + 15)."""
    proc = subprocess.Popen([sys.executable, "-m", "pof_connector.cli", "bench", "index", "--json", "--pages", "2000",
                             "--iterations", "1000000", "--memory-pages", "2000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while not children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            children = _children(proc.pid)
        assert children, "the bench started no server"
        time.sleep(1.0)                          # into its lookups
        proc.terminate()
        assert proc.wait(timeout=30) == 143
        deadline = time.monotonic() + 15
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "the bench's server outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
