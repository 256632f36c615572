"""The session table (TTL, LRU) and sessions through the picker: scale-up, health, weights, cookies."""

from __future__ import annotations

from collections import Counter

import pytest
from envoy.config.core.v3 import health_check_pb2

from ext_proc.picker import pick, session_cookie
from ext_proc.sessions import SessionTable
from ext_proc.view import EndpointView, RoutingTable, ServiceRoute
from tests.unit.ext_proc.test_picker import cla


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_idle_sessions_expire_after_the_ttl():
    clock = Clock()
    t = SessionTable(ttl_s=60, clock=clock)
    t.touch(1, "a:1")
    clock.now += 30
    t.touch(2, "b:1")
    clock.now += 31  # 1 idle for 61 s, 2 for 31 s
    assert t.get(1) is None and t.get(2) == "b:1"
    assert t.sweep() == 1 and len(t) == 1
    t.touch(2, "b:1")  # a request keeps it alive
    clock.now += 59
    assert t.get(2) == "b:1" and t.sweep() == 0


def test_the_least_recently_used_session_goes_when_full():
    t = SessionTable(max_sessions=3)
    for slot in (1, 2, 3):
        t.touch(slot, f"e{slot}:1")
    t.get(1)  # a read alone does not refresh
    t.touch(1, "e1:1")
    t.touch(4, "e4:1")
    assert t.get(2) is None
    assert [t.get(s) for s in (1, 3, 4)] == ["e1:1", "e3:1", "e4:1"]
    assert len(t) == 3


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="ttl_s"):
        SessionTable(ttl_s=0)
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTable(max_sessions=0)


SERVICE = ServiceRoute("llm", ("*",), "v1", {"v1": "llm-v1"}, affinity="soft")
ROUTING = RoutingTable(services=(SERVICE,), session_cookie="sid")
HEALTHY = health_check_pb2.HEALTHY


def view_of(ips: list[str], health: dict[str, int] | None = None, weights: dict[str, int] | None = None):
    assignment = cla("llm-v1", [(ip, (health or {}).get(ip, HEALTHY)) for ip in ips])
    for lb in assignment.endpoints[0].lb_endpoints:
        w = (weights or {}).get(lb.endpoint.address.socket_address.address)
        if w:
            lb.load_balancing_weight.value = w
    return EndpointView.build({"llm-v1": assignment}, ROUTING)


def route_all(view, table: SessionTable, keys: list[bytes]) -> dict[bytes, str]:
    out = {}
    for k in keys:
        d = pick({":authority": b"x", "x-session-id": k}, view, None, table)
        table.touch(d.session, d.endpoint)
        out[k] = d.endpoint
    return out


KEYS = [b"user-%d" % i for i in range(1000)]
FOUR = [f"10.0.0.{i}" for i in range(1, 5)]


def test_live_sessions_do_not_move_when_an_endpoint_is_added():
    """C12 for live sessions: the ring alone moves ~1/5 of 1000 sessions, the table none."""
    table = SessionTable()
    before = route_all(view_of(FOUR), table, KEYS)
    after = route_all(view_of([*FOUR, "10.0.0.5"]), table, KEYS)
    assert after == before
    # New sessions do use the new endpoint, and the ring alone would have moved about 1/5.
    fresh = route_all(view_of([*FOUR, "10.0.0.5"]), SessionTable(), KEYS)
    moved = sum(fresh[k] != before[k] for k in KEYS)
    assert 120 <= moved <= 280
    assert all(fresh[k] == "10.0.0.5:8000" for k in KEYS if fresh[k] != before[k])


def test_a_session_leaves_its_endpoint_only_when_the_endpoint_is_no_longer_pinnable():
    """C10: DRAINING / UNHEALTHY endpoints lose their sessions; everyone else stays."""
    table = SessionTable()
    before = route_all(view_of(FOUR), table, KEYS)
    victim = "10.0.0.2"
    for status in (health_check_pb2.DRAINING, health_check_pb2.UNHEALTHY):
        after = route_all(view_of(FOUR, {victim: status}), table, KEYS)
        assert all(after[k] != f"{victim}:8000" for k in KEYS)
        assert all(after[k] == before[k] for k in KEYS if before[k] != f"{victim}:8000")
        # The moved sessions stay where they moved once the endpoint is back.
        back = route_all(view_of(FOUR), table, KEYS)
        assert back == after
        table = SessionTable()
        before = route_all(view_of(FOUR), table, KEYS)


def test_weight_changes_alone_move_no_session():
    plain = route_all(view_of(FOUR), SessionTable(), KEYS)
    heavy = route_all(view_of(FOUR, weights={"10.0.0.1": 100, "10.0.0.3": 1, "10.0.0.4": 7}), SessionTable(), KEYS)
    assert heavy == plain


def test_session_from_cookie_after_headers():
    table = SessionTable()
    view = view_of(FOUR)
    by_header = pick({":authority": b"x", "x-session-id": b"abc"}, view, None, table)
    by_cookie = pick({":authority": b"x", "cookie": b"theme=dark; sid=abc; x=1"}, view, None, table)
    assert by_cookie.endpoint == by_header.endpoint and by_cookie.session == by_header.session
    header_wins = pick({":authority": b"x", "x-session-id": b"zzz", "cookie": b"sid=abc"}, view, None, table)
    assert header_wins.session != by_header.session
    no_cookie = pick({":authority": b"x", "cookie": b"sidx=abc; other=sid"}, view, None, table)
    assert no_cookie.reason == "least-loaded" and no_cookie.session is None


@pytest.mark.parametrize(("cookie", "want"), [
    (b"sid=1", b"1"), (b"a=b;sid=2", b"2"), (b"  sid=3 ; b=c", b"3"), (b"sid=", None), (b"sid", None),
    (b"", None), (None, None), (b"\xff\xfe=1; sid=\xff", b"\xff"),
])
def test_cookie_parsing(cookie, want):
    assert session_cookie(cookie, b"sid") == want


def test_session_table_holds_hashes_not_keys():
    table = SessionTable()
    route_all(view_of(FOUR), table, [b"secret-user-token"])
    slots = list(table._entries)
    assert len(slots) == 1 and isinstance(slots[0], int)
    assert b"secret" not in repr(table._entries).encode()


def test_sessions_spread_over_endpoints():
    spread = Counter(route_all(view_of(FOUR), SessionTable(), KEYS).values())
    assert min(spread.values()) > 150
