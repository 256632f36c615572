"""``inferlb demo`` without the openai client: a clear message and exit code 2, nothing started."""

from __future__ import annotations

import importlib.util

from inferlb import demo


def test_demo_without_openai_says_which_extra_to_install(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a))
    code = demo.run_demo(duration=1, json_path=None, workdir=str(tmp_path / "w"), concurrency=1, live=False,
                         metrics_source="scrape")
    assert code == 2
    assert "pip install 'inferlb[demo]'" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
