"""bench/request_cost.py: the offline harness decides real requests through the fast transport and
the handler, as Envoy's messages make it do."""

from __future__ import annotations

import json

from bench.request_cost import Client, handler_for, main, one_round


def test_every_request_is_decided_pinned_and_completed():
    handler, cluster = handler_for(2)
    client = Client(handler, cluster, body_kb=2)
    us = one_round(client, 24, batch=4)
    assert us > 0 and client.requests == 24
    # each stream was answered with a decision naming an endpoint (Client raises otherwise), and
    # its completion came back on the access log: nothing left in flight
    assert handler.control.inflight.clusters.get(cluster, 0) == 0
    # the bodies were read: their prompt blocks are in the prefix index, under the endpoints chosen
    assert len(handler.control.prefixes) >= 1


def test_a_get_is_decided_on_its_headers(capsys):
    main(["--body-kb", "0", "--requests", "16", "--rounds", "1"])
    out = json.loads(capsys.readouterr().out)
    assert out["body_kb"] == 0 and out["us_per_request"] > 0 and len(out["rounds"]) == 1
