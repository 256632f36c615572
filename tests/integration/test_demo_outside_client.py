"""``inferlb demo --traffic none``: the whole stack with no load generator serves an outside client.

The demo binds its fixed ports (10000, 18000, ...), so this module runs in the ``heavy`` group
(tests/conftest.py), one after another with the other demo runs.
"""

from __future__ import annotations

import signal
import socket
import time

import openai
import pytest

from inferlb.demo import ENVOY_LISTENER
from inferlb.devstack import stack
from sim.protocol import render_prompt
from sim.tokenizer import load, write_small_tokenizer

pytestmark = pytest.mark.integration


def test_demo_without_traffic_serves_an_openai_client_until_sigint(tmp_path):
    """With the backends counting tokens with a tokenizer on disk (``--tokenizer``): the usage a client
    gets is that tokenizer's count of the rendered prompt."""
    tokenizer = write_small_tokenizer(tmp_path / "tokenizer")
    proc = stack.spawn("demo", stack.inferlb_argv("demo", "--traffic", "none", "--metrics-source", "scrape",
                                                  "--tokenizer", str(tokenizer), "--workdir", str(tmp_path / "work")),
                       tmp_path)
    try:
        deadline = time.monotonic() + 90
        while "ready for any client" not in proc.log_path.read_text() and time.monotonic() < deadline:
            assert proc.alive(), proc.log_tail()
            time.sleep(0.2)
        text = proc.log_path.read_text()
        assert f"ready for any client at http://127.0.0.1:{ENVOY_LISTENER}/v1" in text, proc.log_tail()
        assert "served models: sim-7b, v1, v2" in text
        assert "header 'x-session-id: <id>'" in text and "header 'model-version: v2'" in text
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{ENVOY_LISTENER}/v1", api_key="none", max_retries=0,
                               timeout=20)
        assert [m.id for m in client.models.list()] == ["sim-7b", "v1", "v2"]
        messages = [{"role": "user", "content": "hello"}]
        served = set()
        for _ in range(4):   # one session: one backend
            raw = client.chat.completions.with_raw_response.create(
                model="sim-7b", messages=messages, max_tokens=4, extra_headers={"x-session-id": "outside-1"})
            usage = raw.parse().usage
            assert usage.completion_tokens == 4
            assert usage.prompt_tokens == len(load(tokenizer)(render_prompt("chat", {"messages": messages})))
            assert raw.headers["x-backend-version"] == "v1"
            served.add(raw.headers["x-served-by"])
        assert len(served) == 1
        raw = client.chat.completions.with_raw_response.create(
            model="sim-7b", messages=messages, max_tokens=4, extra_headers={"model-version": "v2"})
        assert raw.headers["x-backend-version"] == "v2"
        time.sleep(1.0)   # no load generator: nothing else reached the backends
        proc.popen.send_signal(signal.SIGINT)
        assert proc.popen.wait(30) == 0, proc.log_tail()
        assert "stopping everything" in proc.log_path.read_text()
        with socket.socket() as s:   # every process of the stack is gone with it
            assert s.connect_ex(("127.0.0.1", ENVOY_LISTENER)) != 0
    finally:
        proc.stop()
