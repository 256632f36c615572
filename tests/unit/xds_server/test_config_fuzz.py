"""Config fuzzing: whatever the text, parse_config returns a Config or raises ConfigError, never anything
else (no traceback for an operator), and every error names a place."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds_server.config import Config, ConfigError, parse_config

VALID = {
    "listen": {"xds": "127.0.0.1:18000", "ext_proc": "127.0.0.1:18080", "admin": "127.0.0.1:18090"},
    "envoy": {"listener": "127.0.0.1:10000", "per_try_timeout_s": 5, "outlier_detection": {"interval_s": 1}},
    "prometheus": {"url": "http://127.0.0.1:9090", "window_s": 30},
    "engine": {"stale_after_s": 15, "scorers": {"latency": 1.0}},
    "services": [{"name": "chat", "default_version": "v1", "versions": [
        {"name": "v1", "endpoints": [{"address": "10.0.0.1:8000", "gpu_class": "a100"}]},
        {"name": "v2", "endpoints": [{"address": "10.0.0.2:8000", "gpu_class": "a10", "max_concurrency": 4}]},
    ]}],
    "admin": {"token": "0123456789abcdef0123"},
}

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["127.0.0.1:0", "[::1]:80", "a100", "v1", "*", "http://x", "-1", "1e400", ".nan", "~"]),
)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.sampled_from(["name", "address", "versions", "endpoints", "services", "url", "tls",
                                     "cert", "gpu_class", "hosts", "x"]) | st.text(max_size=8), inner, max_size=4),
), max_leaves=20)


def _check(text: str) -> None:
    try:
        cfg = parse_config(text, "fuzz.yaml")
    except ConfigError as err:
        message = str(err)
        assert message.startswith("fuzz.yaml"), message
        assert all(line.startswith("fuzz.yaml") for line in message.splitlines()), message
    else:
        assert isinstance(cfg, Config)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p in _paths(VALID) if p]


def _set(doc, path, value):
    import copy

    out = copy.deepcopy(doc)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_any_text_gives_a_config_or_a_config_error(text):
    _check(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_any_yaml_document_gives_a_config_or_a_config_error(doc):
    _check(yaml.safe_dump(doc))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), values)
def test_one_field_of_a_valid_config_replaced_by_anything(path, value):
    _check(yaml.safe_dump(_set(VALID, path, value)))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decoded_leniently(data):
    _check(data.decode("utf-8", errors="replace"))


def test_the_unmutated_config_is_valid():
    assert parse_config(yaml.safe_dump(VALID)).services[0].versions[1].endpoints[0].max_concurrency == 4


def test_yaml_alias_bomb_is_an_error_not_a_hang():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(8)) + "services: *i\n"
    try:
        parse_config(bomb, "fuzz.yaml")
    except ConfigError as err:
        assert "fuzz.yaml" in str(err)
