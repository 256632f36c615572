"""The Policy protocol's data types: prompts, bodies, EDS routes."""

from __future__ import annotations

import orjson

from bench.lab.policy import Eds, Endpoint, Message, Prompt, Request


def _request(headers: dict[str, bytes] | None = None, model: str | None = None) -> Request:
    system = Message("system", "be brief", (1, 2, 3))
    question = Message("user", "why?", (4, 5))
    return Request(7, 1.5, headers or {}, Prompt((system, question)), max_tokens=16, model=model)


def test_prompt_token_ids_are_the_messages_ids_in_order() -> None:
    r = _request()
    assert r.prompt.token_ids == (1, 2, 3, 4, 5)
    assert r.prompt.tokens == 5
    assert r.prompt.chat


def test_body_is_an_openai_chat_body() -> None:
    doc = orjson.loads(_request(model="llama").body)
    assert doc == {"model": "llama", "max_tokens": 16, "stream": True,
                   "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]}


def test_completion_prompt_body() -> None:
    r = Request(1, 0.0, {}, Prompt((Message(None, "once upon", (9,)),)))
    assert not r.prompt.chat
    assert orjson.loads(r.body) == {"prompt": "once upon", "stream": True}


def test_cluster_of_follows_header_then_model_then_default() -> None:
    e = Endpoint("10.0.0.1:8000", "chat-v1", 1, "HEALTHY", "a100")
    eds = Eds(1, 0.0, {"chat-v1": (e,), "chat-v2": ()}, {"v1": "chat-v1", "v2": "chat-v2"}, "v1")
    assert eds.cluster_of(_request({"model-version": b"v2"})) == "chat-v2"
    assert eds.cluster_of(_request({"model-version": b"v9"})) is None
    assert eds.cluster_of(_request(model="v2")) == "chat-v2"
    assert eds.cluster_of(_request(model="llama")) == "chat-v1"
    assert eds.healthy("chat-v1") == (e,)
