"""The decision sampler: every Nth decision, bounded, session keys hashed; wired into the real servicer."""

from __future__ import annotations

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.decision_sampler import holder
from ext_proc.handler import PickerHandler, StreamState
from ext_proc.sampler import DecisionSampler


class Picker(PickerHandler):
    """The picker handler with a one-call ``decide(http_headers)`` for these tests."""

    def decide(self, http_headers: pb.HttpHeaders) -> bytes:
        answer, _ = self.process(StreamState(), pb.ProcessingRequest(request_headers=http_headers).SerializeToString())
        return answer




def http_headers(**headers: str) -> pb.HttpHeaders:
    values = {":authority": "api", ":path": "/v1/chat", **{k.replace("_", "-"): v for k, v in headers.items()}}
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]))


def test_every_nth_decision_is_kept_newest_first_and_bounded():
    sampler = DecisionSampler(every=3, size=2, clock=iter(range(100)).__next__)
    servicer = Picker(holder(), sampler=sampler)
    for i in range(9):
        servicer.decide(http_headers(x_session_id=f"s{i}"))
    kept = sampler.recent()
    assert len(kept) == 2 and [d.at for d in kept] == [2, 1]  # decisions 0, 3, 6 sampled; the newest 2 kept
    assert all(d.reason in ("affinity", "spilled") and d.cluster == "llm-v1" and d.endpoint.startswith("10.0.0.")
               for d in kept)
    # Each names the scheduling plugins that decided it (the admin API shows them).
    assert {d.plugins for d in kept} <= {"prefix-cache", "bounded-load+prefix-cache"}
    assert kept[0].as_dict()["plugins"] == kept[0].plugins
    assert sampler.recent(limit=1) == kept[:1]


def test_samples_hold_a_keyed_hash_of_the_session_never_the_key():
    sampler = DecisionSampler(every=1)
    servicer = Picker(holder(), sampler=sampler)
    servicer.decide(http_headers(x_session_id="alice-secret", model_version="v1"))
    servicer.decide(http_headers(x_session_id="alice-secret"))
    servicer.decide(http_headers(x_user_id="bob"))
    servicer.decide(http_headers(model_version="v9"))
    unknown, bob, alice2, alice1 = sampler.recent()
    assert alice1.session == alice2.session and len(alice1.session) == 16 and int(alice1.session, 16) >= 0
    assert "alice" not in alice1.session and bob.session not in (None, alice1.session)
    assert alice1.version == "v1" and alice2.version is None
    assert (unknown.session, unknown.version, unknown.reason, unknown.status, unknown.cluster) == \
        (None, "v9", "unknown-version", 400, None)
    other = DecisionSampler(every=1)
    Picker(holder(), sampler=other).decide(http_headers(x_session_id="alice-secret"))
    assert other.recent()[0].session != alice1.session  # the key is per process (per sampler)


def test_sampler_refuses_nonsense_settings():
    with pytest.raises(ValueError, match="every"):
        DecisionSampler(every=0)
