"""The policy lab (``inferlb bench lab``): routing policies compared on simulated engines in virtual time.

N engines of ``sim``'s kinds, driven by a discrete-event harness with no sockets, sleeps or threads;
inferlb's own decision code (both loops) beside Envoy's load balancers and the peers' published
algorithms, on the peers' workloads and the seed's traps, as QPS sweeps. Deterministic: the same
seed gives the same JSON. The Policy protocol every policy implements: :mod:`bench.lab.policy`.
"""
