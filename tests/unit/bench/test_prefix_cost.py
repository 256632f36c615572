"""bench/prefix_cost.py: both indexes find their holders at the timed sizes, and every figure is printed."""

from __future__ import annotations

import json

from bench.prefix_cost import main


def test_every_operation_is_timed(capsys):
    main(["--calls", "2", "--rounds", "1"])
    out = json.loads(capsys.readouterr().out)
    assert sorted(out) == ["approximate/insert", "approximate/keys", "approximate/match", "engine_keys/compiled",
                           "engine_keys/python", "precise/insert_holder", "precise/insert_other", "precise/match"]
    assert all(v >= 0 for v in out.values())
