"""Record the TTFT trace that tests/router/test_prefill_fit.py replays (not a test; run by hand).

    flock /tmp/pof-heavy.lock env PYTHONPATH=$PWD ~/.cache/pof/venvs/vllm/bin/python \
        tests/router/data/record_prefill_trace.py tests/router/data/prefill_trace.csv

Recorded 2026-12-01 on the shared 2-core box while other sessions ran vLLM servers (so a computed
token cost ~20 ms, about 100x a quiet GPU-sized start value: the fit must follow that too).
One real vLLM CPU server with the bench model (8 layers, hidden 1024) and
``--enable-prompt-tokens-details``; streamed greedy completions one at a time, as
``vllm bench serve`` sends them (``stream_options.include_usage``), in three rounds: new prompts
of 64..1536 tokens, the same prompts again (the engine's prefix cache holds their full blocks),
then each prompt's first half with a new tail. Each row: prompt tokens, the cached tokens the
engine reported in the answer's usage, the time to the first streamed chunk.
"""

from __future__ import annotations

import csv
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pof_connector.bench.vllm_server import VllmServer, build_model


def stream(url: str, prompt: list[int]) -> tuple[float, int]:
    body: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, cached = 0.0, -1
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not ttft:
                ttft = time.perf_counter() - t0
            usage = json.loads(line[6:]).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if "cached_tokens" in details:
                cached = int(details["cached_tokens"])
    return ttft, cached


def trace_prompts() -> list[list[int]]:
    """The recorded prompts in order (seeded): 24 new ones, the same again, then each one's first
    half with a new tail."""
    rnd = random.Random(14)
    vocab = 7000
    prompts = [[rnd.randrange(10, vocab) for _ in range(rnd.choice([64, 128, 256, 512, 768, 1024, 1536]))]
               for _ in range(24)]
    halves = [p[: len(p) // 2] + [rnd.randrange(10, vocab) for _ in range(len(p) // 2)] for p in prompts]
    return [*prompts, *prompts, *halves]


def main(out: Path) -> None:
    model = build_model("bench")
    rows: list[tuple[int, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = VllmServer(model, Path(tmp), max_model_len=4096,
                            extra_args=["--enable-prompt-tokens-details"]).start()
        try:
            stream(server.url, [5] * 32)                          # warm-up, not recorded
            for k, p in enumerate(trace_prompts()):
                ttft, cached = stream(server.url, p)
                assert cached >= 0, "the server reported no cached_tokens (--enable-prompt-tokens-details?)"
                rows.append((len(p), cached, round(ttft, 5)))
                if k % 24 == 23:
                    print(f"round {k // 24 + 1}/3 done", file=sys.stderr)
        finally:
            server.stop()
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt_tokens", "cached_tokens", "ttft_s"])
        w.writerows(rows)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
