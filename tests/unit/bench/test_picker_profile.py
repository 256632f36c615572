"""``bench.picker_profile``: py-spy's raw samples given to parts of the code."""

from __future__ import annotations

from pathlib import Path

from bench import picker_profile as pp

ROOT = Path(pp.__file__).resolve().parent.parent
LIB = "/usr/lib/python3.11"
SITE = "/usr/lib/python3.11/site-packages"


def _line(thread: str, *frames: tuple[str, str], count: int = 1) -> str:
    stack = ";".join(f"{fn} ({path}:{i + 1})" for i, (fn, path) in enumerate(frames))
    return f"thread (4242): {thread};{stack} {count}"


#: The picker's entry: our CLI starts uvloop, whose Runner.run is the loop.
LOOP = [("<module>", f"{ROOT}/inferlb/cli.py"), ("main", f"{SITE}/click/core.py"),
        ("ext_proc_cmd", f"{ROOT}/inferlb/cli.py"), ("run", f"{SITE}/uvloop/__init__.py"),
        ("Runner.run", f"{LIB}/asyncio/runners.py")]


def test_a_sample_goes_to_the_innermost_file_of_ours():
    raw = [
        _line("MainThread", *LOOP, ("data_received", f"{ROOT}/ext_proc/transport/h2/conn.py"),
              ("process", f"{ROOT}/ext_proc/handler.py"), ("pick", f"{ROOT}/ext_proc/picker.py"),
              ("blake2b", f"{LIB}/hashlib.py"), count=7),
        _line("MainThread", *LOOP, ("data_received", f"{ROOT}/ext_proc/transport/h2/conn.py"), count=3),
    ]
    assert pp.parts(raw) == {"ext_proc/picker.py": 7, "ext_proc/transport/h2/conn.py": 3}


def test_samples_without_a_frame_of_ours_go_to_the_loop_or_to_the_leafs_library():
    raw = [
        _line("MainThread", *LOOP, count=5),
        _line("MainThread", *LOOP, ("write", f"{SITE}/grpc/aio/_call.py"), count=2),
        _line("Thread-3", ("run", f"{LIB}/threading.py"), ("busy", f"{ROOT}/ext_proc/picker.py"), count=9),
        "py-spy> Wrote raw flamegraph data",
        "",
    ]
    got = pp.parts(raw)
    assert got == {pp._LOOP_ENTRY: 5, "library: grpc": 2}  # other threads and non-sample lines left out
    assert pp.parts(raw, thread="Thread-3") == {"ext_proc/picker.py": 9}


def test_a_path_outside_this_projects_root_is_not_ours_even_with_a_package_name_like_ours():
    assert pp._ours(f"{SITE}/otherlib/ext_proc/handler.py") is None
    assert pp._ours(f"{ROOT}/ext_proc/handler.py") == "ext_proc/handler.py"
    assert pp._ours(f"{ROOT}/setup.py") is None


def test_table_shares_leave_the_loops_own_frame_out_and_scale_the_cpu_per_decision():
    rows = pp.table(pp.Counter({pp._LOOP_ENTRY: 50, "a": 3, "b": 1}), us_per_decision=40.0)
    assert [r["part"] for r in rows] == ["a", "b", pp._LOOP_ENTRY]
    assert rows[0]["share"] == 0.75 and rows[0]["us_per_decision"] == 30.0 and rows[1]["us_per_decision"] == 10.0
    assert rows[2] == {"part": pp._LOOP_ENTRY, "samples": 50, "share": None, "us_per_decision": None}
    assert pp.table(pp.Counter(), 40.0) == []
