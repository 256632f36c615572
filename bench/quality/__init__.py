"""``inferlb bench quality``: the classic load-balancing traps, side by side with Envoy's own policies.

Simulated GPU backends (``sim``) behind a real Envoy, real Prometheus, inferlb as a child process.
Each scenario replays one seeded, open-loop request trace against every policy in turn.

Modules: ``scenarios`` (what each trap is: nodes, traffic, events), ``trace`` (the seeded request
trace, pure), ``policies`` (Envoy configs of the baselines and inferlb's config, pure), ``figures``
(results -> latency, error, OOM, version, session figures, pure), ``runner`` (starts and stops the
processes, replays, polls Envoy's weights), ``plots`` (matplotlib PNGs), ``report`` (the
BENCHMARKS.md section and the results store), ``main`` (the run behind the command), ``cli`` (the
click command).
"""
