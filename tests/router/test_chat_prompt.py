"""`pof router` renders chat requests with the model's chat template and tokenizes them itself, as
vLLM does (the same transformers call, no special tokens added); the requests it cannot render
so go to a backend's /tokenize with the fields that change their prompt. The engines are the
stand-ins of test_proxy.py; the same rendering against a real vLLM server's /tokenize is in
tests/adapters/test_vllm_router.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pof_connector.bench.make_model import BOS, CHAT_TEMPLATE, EOS, PAD
from pof_connector.config import ConfigError
from pof_connector.router.chat_prompt import ChatPrompt
from pof_connector.router.prefix_tokenizer import PrefixTokenizer
from pof_connector.router.proxy import make_app
from pof_connector.router.serve import build
from tests.router.test_proxy import StandInEngine, engines, router_config  # noqa: F401  (fixture)

SYSTEM = "you are a careful helper who answers in one line " * 40
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello world, what is new"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as ci/make_model.py writes one (byte-level BPE, bos/eos/pad, its chat
    template), without the weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("chat-model")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([SYSTEM, "hello world, the quick brown fox"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]", BOS, EOS, PAD]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out))
    return out


def test_a_chat_request_is_rendered_and_tokenized_as_the_engine_does(chat_model: Path) -> None:
    chat = ChatPrompt.load(str(chat_model))
    assert chat is not None
    text, special = chat.render({"model": "m", "messages": MESSAGES, "max_tokens": 4, "stream": True})
    assert text == f"<|system|>\n{SYSTEM}{EOS}\n<|user|>\nhello world, what is new{EOS}\n<|assistant|>\n"
    assert special is False
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(chat_model / "tokenizer.json"))
    local = PrefixTokenizer(raw)
    assert local.cached
    want = raw.encode(text, add_special_tokens=False).ids
    assert local(text, False) == want and local(text, False) == want         # cold, then from the cache
    # the request's own flags, as vLLM reads them
    closed, _ = chat.render({"messages": MESSAGES, "add_generation_prompt": False})
    assert closed == text.removesuffix("<|assistant|>\n")
    assert chat.render({"messages": MESSAGES, "add_special_tokens": True}) == (text, True)
    # both steps at once, as the benches and tests build a request's ids
    assert chat.tokens({"messages": MESSAGES}, local) == want
    asked: list[tuple[str, bool]] = []
    assert chat.tokens({"messages": MESSAGES, "add_special_tokens": True},
                       lambda t, special: asked.append((t, special)) or [7]) == [7]
    assert asked == [(text, True)]
    assert chat.tokens({"messages": MESSAGES, "tools": []}, local) is None


@pytest.mark.parametrize("body", [
    {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": MESSAGES, "chat_template": "{{ messages[0]['content'] }}"},
    {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]},
    {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
    {"messages": MESSAGES, "add_generation_prompt": "yes"},
    {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
    {"messages": []},
    {"messages": "hi"},
], ids=["tools", "own-template", "template-kwargs", "content-parts", "developer", "tool-role", "tool-calls",
        "flag-not-bool", "both-flags", "no-message", "not-a-list"])
def test_what_the_router_does_not_render_is_left_to_a_backend(chat_model: Path, body: dict[str, Any]) -> None:
    chat = ChatPrompt.load(str(chat_model))
    assert chat is not None and chat.render(body) is None


def test_chat_requests_are_tokenized_in_the_router_and_others_by_a_backend_with_their_fields(
        engines: dict[str, StandInEngine], chat_model: Path) -> None:  # noqa: F811
    for e in engines.values():
        e.model_root = str(chat_model)
    router, _ = build(router_config(engines, policy="least_loaded"))
    with TestClient(make_app(router)) as client:
        deadline = time.monotonic() + 30          # transformers is imported off the event loop
        while True:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 4})
            assert r.status_code == 200, r.text
            if r.headers["x-pof-tokens"] == "local":
                break
            assert time.monotonic() < deadline, "chat requests never tokenized locally"
            time.sleep(0.1)
        asked = sum(e.tokenized for e in engines.values())
        for _ in range(3):
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 4})
            assert r.headers["x-pof-tokens"] == "local"
        assert sum(e.tokenized for e in engines.values()) == asked        # no /tokenize round trip
        # a long conversation (rendered off the event loop) too
        many = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(501)]
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": many, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-tokens"] == "local"
        assert sum(e.tokenized for e in engines.values()) == asked
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "tools": tools,
                                                      "temperature": 0, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pof-tokens"] == "backend"
    sent = [b for e in engines.values() for b in e.tokenize_bodies][-1]
    assert sent == {"model": "m", "messages": MESSAGES, "tools": tools}       # what changes the prompt, only


def test_the_backends_own_chat_template_file_or_none(
        engines: dict[str, StandInEngine], chat_model: Path, tmp_path: Path,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    own = tmp_path / "template.jinja"
    own.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    router, _ = build(router_config(engines, policy="least_loaded", tokenizer=str(chat_model),
                                    chat_template=str(own)))
    with TestClient(make_app(router)) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
        assert r.headers["x-pof-tokens"] == "local"
    chat = ChatPrompt.load(str(chat_model), own.read_text())
    assert chat is not None and chat.render({"messages": [{"role": "user", "content": "hello"}]}) == \
        ("[user] hello\n", False)
    router, _ = build(router_config(engines, tokenizer=str(chat_model), chat_template=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="chat_template: cannot read"):
        make_app(router)
    # a model directory without a chat template: chat requests go to a backend, said once
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((chat_model / "tokenizer.json").read_bytes())
    router, _ = build(router_config(engines, policy="least_loaded", tokenizer=str(bare)))
    with caplog.at_level(logging.INFO, logger="pof.router"), TestClient(make_app(router)) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
        assert r.headers["x-pof-tokens"] == "backend"
    assert "chat requests are tokenized by a backend" in caplog.text
