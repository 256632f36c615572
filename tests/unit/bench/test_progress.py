"""Benchmark progress off a terminal: one line per step with the step's label and the time left."""

from __future__ import annotations

from bench.progress import Progress


def test_plain_lines_name_the_step_and_the_time_left(capsys):
    with Progress(3, 10.0, "bench quality") as p:
        p.step("uneven, round_robin, round 1")
        p.step("uneven, inferlb_full, round 1")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[1/3] bench quality: uneven, round_robin, round 1  ~30 s left"
    assert lines[1].startswith("[2/3] bench quality: uneven, inferlb_full, round 1  ~")
    assert p.done == 2
