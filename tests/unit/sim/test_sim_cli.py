"""The sim-backend click command: options and config errors (no server started)."""

from click.testing import CliRunner

from sim.cli import sim_backend


def test_help_lists_the_options():
    result = CliRunner().invoke(sim_backend, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--host", "--port", "--gpu-class", "--version", "--gpu-memory-mib", "--max-concurrency",
        "--long-tail", "--legacy-metrics", "--seed", "--time-scale", "--model-name",
    ):  # fmt: skip
        assert option in result.output


def test_bad_values_are_usage_errors(monkeypatch):
    monkeypatch.setattr("sim.server.run_backend", lambda cfg: (_ for _ in ()).throw(AssertionError("ran")))
    runner = CliRunner()
    assert runner.invoke(sim_backend, ["--gpu-class", "v100"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--long-tail", "1.5"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--time-scale", "0"]).exit_code == 2
    result = runner.invoke(sim_backend, ["--gpu-memory-mib", "1000"])  # smaller than the weights
    assert result.exit_code == 2 and "weights" in result.output


def test_options_reach_the_config(monkeypatch):
    seen = []
    monkeypatch.setattr("sim.server.run_backend", seen.append)
    args = ["--port", "0", "--gpu-class", "a10", "--version", "v2", "--max-concurrency", "4", "--long-tail",
            "0.1", "--legacy-metrics", "--seed", "9", "--time-scale", "0.5", "--model-name", "m"]  # fmt: skip
    result = CliRunner().invoke(sim_backend, args)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.port, cfg.gpu_class, cfg.version, cfg.max_concurrency) == (0, "a10", "v2", 4)
    assert (cfg.long_tail, cfg.legacy_metrics, cfg.seed, cfg.time_scale) == (0.1, True, 9, 0.5)
    assert cfg.model_name == "m" and cfg.gpu_memory_total_mib == 24576
