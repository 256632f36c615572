"""The sim-backend click command: options and config errors (no server started)."""

from click.testing import CliRunner

from sim.cli import sim_backend


def test_help_lists_the_options():
    result = CliRunner().invoke(sim_backend, ["--help"])
    assert result.exit_code == 0
    for option in (
        "--host", "--port", "--gpu-class", "--version", "--gpu-memory-mib", "--max-concurrency",
        "--long-tail", "--legacy-metrics", "--seed", "--time-scale", "--model-name", "--engine", "--model",
        "--max-num-batched-tokens",
    ):  # fmt: skip
        assert option in result.output


def test_bad_values_are_usage_errors(monkeypatch):
    monkeypatch.setattr("sim.server.run_backend", lambda cfg: (_ for _ in ()).throw(AssertionError("ran")))
    runner = CliRunner()
    assert runner.invoke(sim_backend, ["--gpu-class", "v100"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--long-tail", "1.5"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--time-scale", "0"]).exit_code == 2
    result = runner.invoke(sim_backend, ["--gpu-memory-mib", "1000"])  # smaller than the weights
    assert result.exit_code == 2 and "no memory left for the KV cache" in result.output
    result = runner.invoke(sim_backend, ["--engine", "job", "--gpu-memory-mib", "1000"])
    assert result.exit_code == 2 and "must exceed the model weights" in result.output
    result = runner.invoke(sim_backend, ["--max-concurrency", "512", "--max-num-batched-tokens", "256"])
    assert result.exit_code == 2 and "max_num_batched_tokens" in result.output
    assert runner.invoke(sim_backend, ["--engine", "tgi"]).exit_code == 2


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
    assert (cfg.engine, cfg.model, cfg.max_num_batched_tokens) == ("llm", "llama-3.1-8b", None)
    seen.clear()
    result = CliRunner().invoke(sim_backend, ["--engine", "job", "--max-num-batched-tokens", "4096"])
    assert result.exit_code == 0, result.output
    assert (seen[0].engine, seen[0].max_num_batched_tokens) == ("job", 4096)


def test_etcd_options_reach_the_config_and_bad_ones_are_usage_errors(monkeypatch):
    seen = []
    monkeypatch.setattr("sim.server.run_backend", seen.append)
    runner = CliRunner()
    args = ["--etcd", "http://127.0.0.1:2379", "--etcd-prefix", "/p/", "--etcd-ttl", "5", "--etcd-service", "chat",
            "--etcd-address", "10.0.0.5:8000", "--etcd-status-interval-s", "1", "--etcd-drain-s", "0"]
    result = runner.invoke(sim_backend, args)
    assert result.exit_code == 0, result.output
    (cfg,) = seen
    assert (cfg.etcd, cfg.etcd_prefix, cfg.etcd_ttl_s, cfg.etcd_service, cfg.etcd_address) == (
        "http://127.0.0.1:2379", "/p/", 5, "chat", "10.0.0.5:8000")
    assert (cfg.etcd_status_interval_s, cfg.etcd_drain_s) == (1.0, 0.0)
    assert runner.invoke(sim_backend, ["--etcd", "127.0.0.1:2379"]).exit_code == 2   # not a URL
    assert runner.invoke(sim_backend, ["--etcd", "http://a:2379,b:2379"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--etcd-ttl", "0"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--etcd-user", ":pw"]).exit_code == 2
    assert runner.invoke(sim_backend, ["--etcd-prefix", ""]).exit_code == 2


def test_the_registration_value_carries_identity_capacity_and_status():
    from sim.config import BackendConfig
    from sim.etcd import registration_value
    from sim.node import SimNode

    node = SimNode(BackendConfig(port=8001, gpu_class="a10", version="v2", max_concurrency=4))
    value = registration_value(node, "127.0.0.1:8001", "chat", draining=True)
    assert {k: value[k] for k in ("address", "service", "version", "gpu_class", "max_concurrency",
                                  "gpu_memory_mib", "draining")} == {
        "address": "127.0.0.1:8001", "service": "chat", "version": "v2", "gpu_class": "a10", "max_concurrency": 4,
        "gpu_memory_mib": 24576.0, "draining": True}
    status = value["status"]
    assert (status["running"], status["waiting"], status["kv_cache_usage"], status["gpu_utilization"]) == (0, 0, 0, 0)
    assert 0 < status["gpu_memory_free_mib"] < 24576


def test_a_port_in_use_is_one_error_line_not_a_traceback():
    """Found by a new-user trial: the bind's OSError came out as a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(sim_backend, ["--port", str(port)])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == f"Error: --host/--port 127.0.0.1:{port}: address already in use"
