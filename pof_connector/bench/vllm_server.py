"""A real vLLM OpenAI server run as a subprocess (tests, ``pof bench vllm``, the quickstart),
stopped by its PID. Imports no vLLM: it only needs a Python that has vLLM installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pof_connector.bench.service_process import ServiceProcess

MODEL_CACHE = Path(os.environ.get("POF_MODEL_CACHE", Path.home() / ".cache" / "pof" / "models"))


def build_model(preset: str = "tiny", python: str | None = None, *, tokenizer_only: bool = False) -> Path:
    """A locally built Llama (no hub), reused when already built (make_model keeps a marker).

    ``python`` must have the pinned transformers/tokenizers of the vLLM venv (the default is
    this interpreter): the files depend on their versions. ``tokenizer_only``: the preset's
    tokenizer and chat template alone, in a directory of their own (``PRESET-tokenizer``); they
    need no torch, so the core install can build them."""
    out = MODEL_CACHE / (f"{preset}-tokenizer" if tokenizer_only else preset)
    subprocess.run([python or sys.executable, "-m", "pof_connector.bench.make_model", "--preset", preset,
                    "--out", str(out), *(["--tokenizer-only"] if tokenizer_only else [])],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connector_config(extra: dict[str, Any], policy: str = "recompute", role: str = "kv_both") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for pof with ``extra`` as its pool config. Benches and tests
    time and count pool hits: unless ``extra`` says otherwise, the audit is off (``sample_rate`` 0;
    a user's default is 0.01), so no hit is turned into a recompute behind their back."""
    extra = {"audit": {"sample_rate": 0}, **extra}
    return {"kv_connector": "PoFConnector", "kv_connector_module_path": "pof_connector.adapters.vllm",
            "kv_role": role, "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


class VllmServer(ServiceProcess):
    def __init__(self, model: Path, workdir: Path, *, kv_transfer: dict[str, Any] | None = None,
                 max_model_len: int = 4096, kv_cache_gib: int = 1, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, python: str | None = None, dtype: str | None = None) -> None:
        """``python``: an interpreter with vLLM installed (default: this one); ``dtype``: vLLM's
        ``--dtype`` (``None``: the model's own, which vLLM's ``auto`` downcasts from float32)."""
        self.model = model
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_transfer = kv_transfer
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = [*(["--dtype", dtype] if dtype else []), *(extra_args or [])]
        self.env = env or {}
        self.python = python or sys.executable
        super().__init__(workdir / f"vllm-{self.port}.log")

    def start(self, timeout_s: float = 400) -> VllmServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        scratch = self.workdir / "scratch"
        env = {**dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                      VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), VLLM_SERVER_DEV_MODE="1",
                      VLLM_CACHE_ROOT=str(MODEL_CACHE.parent / "vllm-cache"),
                      TORCHINDUCTOR_CACHE_DIR=str(MODEL_CACHE.parent / "inductor-cache"),
                      TMPDIR=str(scratch), PYTHONUNBUFFERED="1"), **self.env}
        scratch.mkdir(exist_ok=True)
        # The module `-m vllm.entrypoints.openai.api_server` (deprecated) hands over to; `vllm serve`
        # fails on the CPU build: it asks for the version of a package "vllm", and it is "vllm-cpu".
        args = [self.python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(self.model),
                "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--seed", "0", *self.extra_args]
        if self.kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        self.launch(args, env=env, cwd=self.workdir)
        self.wait_healthy(self.url + "/health", timeout_s, interval_s=1.0)
        return self


    # ---- HTTP ----------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def complete(self, prompt: list[int], max_tokens: int = 16, cache_salt: str | None = None) -> list[int]:
        """Greedy completion of a token-id prompt; returns the generated token ids."""
        body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = self.post("/v1/completions", body)
        return list(out["choices"][0]["token_ids"])

    def timed_complete(self, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int]]:
        """Time to first token (a one-token completion's latency, as the client sees it)."""
        t0 = time.perf_counter()
        tokens = self.complete(prompt, max_tokens)
        return time.perf_counter() - t0, tokens

    def stream(self, prompt: list[int], max_tokens: int = 16, cache_salt: str | None = None) -> tuple[float, str]:
        """Stream a greedy completion; returns (time to the first token in seconds, the text)."""
        return stream_completion(self.url, prompt, max_tokens, cache_salt)

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def metrics(self, names: Sequence[str] = ()) -> dict[str, float]:
        """Prometheus samples summed over label sets: ``{"vllm:x_total": v, 'vllm:x_total{a="b"}': v}``.
        ``names``: only these series (sample names, a counter's with ``_total``), which the
        server renders alone instead of its whole ~55 KB page: a bench sampling while it measures
        takes that CPU from the engine (``/metrics/``: see
        :class:`~pof_connector.locality.engine_load.MetricsPage`)."""
        query = "/?" + urllib.parse.urlencode([("name[]", n) for n in names]) if names else ""
        with urllib.request.urlopen(self.url + "/metrics" + query, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            out[series] = float(value)
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server and all its processes."""
        assert self.proc is not None
        total = 0
        for pid in [*_descendants(self.proc.pid), self.proc.pid]:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except FileNotFoundError:
                pass
        return total


def stream_completion(url: str, prompt: list[int] | str, max_tokens: int = 16,
                      cache_salt: str | None = None, chunk_times: list[float] | None = None,
                      headers: dict[str, str] | None = None) -> tuple[float, str]:
    """Stream a greedy completion from an OpenAI server (or a router) at ``url``; returns (seconds
    to the first streamed token, the text). ``chunk_times``: gets the seconds from the request to
    each streamed chunk (one token each, as vLLM streams); ``headers``: gets the answer's headers
    (lower-case names; a router's ``x-pof-*`` say how it routed)."""
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return _stream(url + "/v1/completions", body, lambda choice: choice.get("text", ""), chunk_times, headers)


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int = 16,
                headers: dict[str, str] | None = None) -> tuple[float, str]:
    """:func:`stream_completion` for a chat request of ``messages``. Its first token is the first
    chunk with content, as ``vllm bench serve`` counts it (vLLM's first chunk names the role)."""
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    return _stream(url + "/v1/chat/completions", body,
                   lambda choice: (choice.get("delta") or {}).get("content") or "", None, headers)


def _stream(url: str, body: dict[str, Any], piece_of: Callable[[dict[str, Any]], str],
            chunk_times: list[float] | None, headers: dict[str, str] | None) -> tuple[float, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text = 0.0, []
    with urllib.request.urlopen(req, timeout=600) as r:
        if headers is not None:
            headers.update((k.lower(), v) for k, v in r.headers.items())
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = piece_of(choices[0])
            if not piece and "delta" in choices[0]:
                continue                # a chat chunk without content (the role, the finish reason)
            if not ttft:
                ttft = time.perf_counter() - t0
            if chunk_times is not None:
                chunk_times.append(time.perf_counter() - t0)
            text.append(piece)
    return ttft, "".join(text)


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return out
    for c in children:
        out.append(int(c))
        out += _descendants(int(c))
    return out
