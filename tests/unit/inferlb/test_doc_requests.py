"""The chat request the README and docs/operations.md show works as written: its body is a JSON chat
request (it was ``-d '{...}'``, which a server answers 400 "request body is not valid JSON") and it
says so in ``content-type``."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sim.protocol import parse_request

ROOT = Path(__file__).resolve().parents[3]


def _chat_curls(text: str) -> list[list[str]]:
    """The argv of every ``curl`` command line (backslash continuations joined) that posts to
    ``/v1/chat/completions``."""
    text = text.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines()
            if re.match(r"\s*curl\s", line) and "/v1/chat/completions" in line]


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
def test_the_documented_chat_request_is_valid(doc):
    curls = _chat_curls((ROOT / doc).read_text())
    assert curls, f"{doc}: no chat request example"
    for argv in curls:
        body = argv[argv.index("-d") + 1]
        headers = dict(h.split(": ", 1) for h in (argv[i + 1] for i, a in enumerate(argv) if a == "-H"))
        assert headers.get("content-type") == "application/json", argv
        req = parse_request("chat", body.encode(), headers)   # raises RequestError as the server would
        assert json.loads(body)["messages"] and req.session_key == "chat-42"
