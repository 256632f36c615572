"""The quality benchmark's plots draw every policy the scenario ran."""

from __future__ import annotations

from matplotlib.axes import Axes

from bench.quality import plots
from bench.quality.policies import policies_for
from bench.quality.runner import PolicyRun, ScenarioRun
from bench.quality.scenarios import SCENARIOS


def test_the_cdfs_of_a_gateway_scenario_draw_its_own_policies(tmp_path, monkeypatch):
    scenario = SCENARIOS["multi_gateway"]
    run = ScenarioRun(scenario, quick=True, seed=1, warmup_s=1.0, measure_s=1.0, requests=3, addresses=[])
    for policy in policies_for(scenario):
        run.runs[policy] = [PolicyRun(policy, {}, [10.0, 20.0], [], [], 0.0, {}, ttfts_ms=[5.0, 6.0])]
    drawn: list[str] = []
    step = Axes.step
    monkeypatch.setattr(Axes, "step", lambda self, *a, **kw: (drawn.append(kw["label"]), step(self, *a, **kw))[1])
    plots.ttft_cdf(run, tmp_path / "ttft.png")
    plots.latency_cdf(run, tmp_path / "latency.png")
    assert sorted(label.split(" ")[0] for label in drawn) == sorted(policies_for(scenario) * 2)
