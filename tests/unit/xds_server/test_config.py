"""YAML config -> typed, validated Config: defaults, errors that name field and line, refusals."""

from __future__ import annotations

import re

import pytest

from inferlb.picker_config import routing_table
from tests.support.factories import config, line_of, service, version, yaml_text
from xds_server.config import ConfigError, load_config, parse_config, split_hostport

MINIMAL = yaml_text(
    """
    services:
      - name: llm
        versions:
          - name: v1
            endpoints:
              - address: 10.0.0.1:8000
    """
)


def errors_of(text: str, source: str = "cfg.yaml") -> list[str]:
    """The problems ``parse_config`` reports, one per line."""
    with pytest.raises(ConfigError) as info:
        parse_config(text, source)
    return str(info.value).splitlines()


def one_error(text: str, source: str = "cfg.yaml") -> str:
    lines = errors_of(text, source)
    assert len(lines) == 1, lines
    return lines[0]


# --- defaults -------------------------------------------------------------------------------------


def test_defaults_follow_the_design_contracts():
    cfg = parse_config(MINIMAL)
    assert cfg.listen.xds == "127.0.0.1:18000"
    assert cfg.listen.ext_proc == "127.0.0.1:18080"
    assert cfg.listen.admin == "127.0.0.1:18090"
    assert cfg.headers.version == "model-version"
    assert cfg.headers.session == ("x-session-id", "x-user-id")
    assert cfg.headers.override_host == "x-gateway-destination-endpoint"
    assert cfg.headers.cluster == "x-inferlb-cluster"


def test_envoy_side_defaults():
    cfg = parse_config(MINIMAL)
    assert cfg.envoy.listener == "127.0.0.1:10000"
    assert cfg.envoy.failure_mode_allow is True
    assert cfg.envoy.ext_proc_address is None
    assert 0 < cfg.envoy.ext_proc_timeout_s <= 1


def test_envoy_side_addresses_may_be_host_names_but_must_have_a_port():
    cfg = parse_config(MINIMAL + "envoy:\n  ext_proc_address: inferlb.internal:18080\n")
    assert cfg.envoy.ext_proc_address == "inferlb.internal:18080"
    text = MINIMAL + "envoy:\n  listener: 127.0.0.1\n"
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, 'listener:')}: envoy.listener: ")


def test_engine_and_endpoint_defaults():
    cfg = parse_config(MINIMAL)
    assert cfg.engine.stale_after_s == 15.0
    assert cfg.engine.memory_margin == pytest.approx(0.2)
    assert cfg.engine.request_memory_mib == 2048.0
    assert cfg.prometheus.window_s == 60.0
    ep = cfg.services[0].versions[0].endpoints[0]
    assert ep.gpu_class == "a100"
    assert ep.instance == "10.0.0.1:8000"  # the Prometheus instance defaults to the address
    assert cfg.memory_mib(ep) == cfg.gpu_classes["a100"].memory_mib
    assert set(cfg.gpu_classes) == {"a100", "h100", "a10", "l4"}
    assert cfg.services[0].hosts == ("*",)
    assert cfg.services[0].lb_policy == "least_request"


def test_default_version_is_the_first_unless_named():
    svc = config([service("llm", [version("v1", 1), version("v2", 1)])]).services[0]
    assert svc.default == "v1"
    svc = config([service("llm", [version("v1", 1), version("v2", 1)], default_version="v2")]).services[0]
    assert svc.default == "v2"


def test_endpoint_overrides_memory_and_instance():
    cfg = config([service("llm", [version("v1", [
        {"address": "10.0.0.1:8000", "gpu_memory_mib": 40960, "metrics_instance": "gpu-1:9400"},
    ])])])
    ep = cfg.services[0].versions[0].endpoints[0]
    assert cfg.memory_mib(ep) == 40960
    assert ep.instance == "gpu-1:9400"


def test_ipv6_endpoint_address_is_accepted_and_split():
    cfg = config([service("llm", [version("v1", [{"address": "[fd00::1]:8000"}])])])
    assert split_hostport(cfg.services[0].versions[0].endpoints[0].address) == ("fd00::1", 8000)


def test_load_config_reads_a_file(tmp_path):
    path = tmp_path / "inferlb.yaml"
    path.write_text(MINIMAL)
    assert load_config(path).services[0].versions[0].endpoints[0].address == "10.0.0.1:8000"


def test_routing_table_from_config():
    cfg = config(
        [
            service("llm", [version("v1", 1), version("v2", 1)], hosts=["api.example.com"], default_version="v2"),
            service("embed", [version("e1", 1)], hosts=["embed.example.com"]),
        ],
        headers={"version": "x-model", "session": ["x-sess"], "cluster": "x-c", "override_host": "x-h"},
    )
    table = routing_table(cfg)
    assert table.version_header == "x-model"
    assert table.session_headers == ("x-sess",)
    assert (table.cluster_header, table.override_host_header) == ("x-c", "x-h")
    llm, embed = table.services
    assert dict(llm.clusters) == {"v1": "llm-v1", "v2": "llm-v2"}
    assert llm.default_version == "v2"
    assert llm.hosts == ("api.example.com",)
    assert dict(embed.clusters) == {"e1": "embed-e1"}


# --- errors name the field path and the line ------------------------------------------------------


def test_hostname_endpoint_address_is_refused_with_path_and_line():
    text = yaml_text(
        """
        services:
          - name: llm
            versions:
              - name: v1
                endpoints:
                  - address: 10.0.0.1:8000
                  - address: gpu-2.local:8000
        """
    )
    err = one_error(text, "file.yaml")
    prefix = f"file.yaml:{line_of(text, 'gpu-2.local')}: services[0].versions[0].endpoints[1].address: "
    assert err.startswith(prefix), err
    assert "IP address" in err and "gpu-2.local:8000" in err


@pytest.mark.parametrize("address", ["10.0.0.1", "10.0.0.1:70000", "10.0.0.1:http", ":8000", "10.0.0.300:80",
                                     "10.0.0.1:0", "0.0.0.0:8000", "'[::]:8000'"])
def test_bad_endpoint_address_forms_are_refused(address):
    text = MINIMAL.replace("10.0.0.1:8000", address)
    err = one_error(text)
    assert f"cfg.yaml:{line_of(text, 'address:')}: services[0].versions[0].endpoints[0].address: " in err


def test_error_in_a_nested_section_names_its_line():
    text = yaml_text(
        """
        listen:
          xds: 127.0.0.1:18000
          admin: "127.0.0.1:99999"
        services:
          - name: llm
            versions:
              - name: v1
                endpoints:
                  - address: 10.0.0.1:8000
        """
    )
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, '99999')}: listen.admin: ")


@pytest.mark.parametrize(
    ("text", "path", "needle"),
    [
        (MINIMAL + "bogus: 1\n", "bogus", "bogus"),
        (MINIMAL.replace("  - name: llm\n", "  - name: llm\n    colour: blue\n"), "services[0].colour", "colour"),
        (MINIMAL + "engine:\n  stale_after: 3\n", "engine.stale_after", "stale_after"),
        (
            MINIMAL.replace("- address: 10.0.0.1:8000", "- address: 10.0.0.1:8000\n            weight: 3"),
            "services[0].versions[0].endpoints[0].weight",
            "weight: 3",
        ),
    ],
)
def test_unknown_keys_are_refused(text, path, needle):
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, needle)}: {path}: "), err
    assert "not permitted" in err


def test_every_problem_is_listed_one_per_line():
    text = yaml_text(
        """
        engine:
          hysteresis: 1.5
        services:
          - name: llm
            versions:
              - name: v-1
                endpoints:
                  - address: example.com:80
        """
    )
    errors = errors_of(text)
    paths = {e.split(": ")[1] for e in errors}
    assert paths == {
        "engine.hysteresis", "services[0].versions[0].name", "services[0].versions[0].endpoints[0].address"
    }
    for e in errors:
        assert re.match(r"^cfg\.yaml:\d+: ", e), e
    by_path = {e.split(": ")[1]: int(e.split(":")[1]) for e in errors}
    assert by_path["engine.hysteresis"] == line_of(text, "hysteresis")
    assert by_path["services[0].versions[0].name"] == line_of(text, "v-1")


def test_version_name_with_dash_is_refused():
    text = MINIMAL.replace("name: v1", "name: v-1")
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, 'v-1')}: services[0].versions[0].name: "), err


def test_a_version_name_longer_than_the_picker_reads_is_refused():
    """The picker reads at most 256 bytes of a version header or body ``model``: a longer name could
    never be chosen."""
    assert parse_config(MINIMAL.replace("name: v1", "name: v" + "1" * 255)).services[0].versions[0].name
    text = MINIMAL.replace("name: v1", "name: v" + "1" * 256)
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, 'v1111')}: services[0].versions[0].name: ")


def test_service_name_pattern():
    text = MINIMAL.replace("name: llm", "name: -llm")
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, '-llm')}: services[0].name: ")


def test_default_version_must_be_a_version():
    text = MINIMAL.replace("  - name: llm\n", "  - name: llm\n    default_version: v9\n")
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, '- name: llm')}: services[0]: "), err
    assert "'v9'" in err and "v1" in err


def test_unavailable_versions_may_be_the_default_but_not_a_version_with_endpoints():
    text = MINIMAL.replace("  - name: llm\n",
                           "  - name: llm\n    default_version: v2\n    unavailable_versions: [v2]\n")
    svc = parse_config(text).services[0]
    assert svc.default == "v2" and svc.unavailable_versions == ("v2",) and [v.name for v in svc.versions] == ["v1"]
    err = one_error(MINIMAL.replace("  - name: llm\n", "  - name: llm\n    unavailable_versions: [v1]\n"))
    assert "unavailable_versions" in err and "'v1'" in err, err


def test_duplicate_version_names_are_refused():
    text = yaml_text(
        """
        services:
          - name: llm
            versions:
              - name: v1
                endpoints: [{address: 10.0.0.1:8000}]
              - name: v1
                endpoints: [{address: 10.0.0.2:8000}]
        """
    )
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, '- name: llm')}: services[0]: "), err
    assert "duplicate version" in err


DUP_ENDPOINT = yaml_text(
    """
    services:
      - name: llm
        versions:
          - name: v1
            endpoints:
              - address: 10.0.0.1:8000
          - name: v2
            endpoints:
              - address: 10.0.0.1:8000
    """
)

DUP_SERVICE = yaml_text(
    """
    services:
      - name: llm
        versions:
          - name: v1
            endpoints: [{address: 10.0.0.1:8000}]
      - name: llm
        versions:
          - name: v2
            endpoints: [{address: 10.0.0.2:8000}]
    """
)

UNKNOWN_GPU = yaml_text(
    """
    services:
      - name: llm
        versions:
          - name: v1
            endpoints:
              - address: 10.0.0.1:8000
              - address: 10.0.0.2:8000
                gpu_class: t4
    """
)


def test_duplicate_endpoint_is_refused():
    err = one_error(DUP_ENDPOINT)
    assert "10.0.0.1:8000" in err and "twice" in err
    assert "llm-v1" in err and "llm-v2" in err


@pytest.mark.parametrize(("written", "canonical"), [
    ("127.0.0.1:08701", "127.0.0.1:8701"),
    ("[FD00:0:0::1]:8000", "[fd00::1]:8000"),
    ("[fd00:0000:0000:0000:0000:0000:0000:0001]:08000", "[fd00::1]:8000"),
])
def test_endpoint_addresses_are_kept_in_their_canonical_spelling(written, canonical):
    """Issue 15 item 5: one socket address, one spelling (Envoy merges the spellings)."""
    ep = parse_config(MINIMAL.replace("10.0.0.1:8000", f"'{written}'")).services[0].versions[0].endpoints[0]
    assert (ep.address, ep.instance) == (canonical, canonical)


@pytest.mark.parametrize(("first", "second"), [
    ("127.0.0.1:8701", "127.0.0.1:08701"),
    ("[fd00::1]:8000", "[FD00:0::0:1]:8000"),
])
def test_two_spellings_of_one_address_are_refused_with_field_and_line(first, second):
    text = yaml_text(
        f"""
        services:
          - name: llm
            versions:
              - name: v1
                endpoints:
                  - address: "{first}"
                  - address: "{second}"
        """
    )
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, second)}: services[0].versions[0].endpoints[1].address: "), err
    assert "listed twice" in err and "canonical spelling" in err


def test_ipv6_endpoint_address_without_brackets_is_refused():
    err = one_error(MINIMAL.replace("10.0.0.1:8000", '"fd00::1:8000"'))
    assert "needs brackets" in err and "[fd00::1]:8000" in err


def test_duplicate_service_is_refused():
    err = one_error(DUP_SERVICE)
    assert "services[1].name" in err and "defined twice" in err and "llm" in err


def test_unknown_gpu_class_is_refused():
    err = one_error(UNKNOWN_GPU)
    assert "'t4'" in err
    for known in ("a10", "a100", "h100"):
        assert known in err


def test_custom_gpu_class_is_accepted():
    cfg = parse_config(
        UNKNOWN_GPU
        + "gpu_classes:\n  t4: {capacity: 0.25, memory_mib: 16384}\n  a100: {capacity: 1, memory_mib: 81920}\n"
    )
    ep = cfg.services[0].versions[0].endpoints[1]
    assert cfg.gpu_classes[ep.gpu_class].capacity == 0.25
    assert cfg.memory_mib(ep) == 16384


@pytest.mark.parametrize(
    ("text", "path", "needle", "nth"),
    [
        (UNKNOWN_GPU, "services[0].versions[0].endpoints[1].gpu_class", "gpu_class: t4", 1),
        (DUP_ENDPOINT, "services[0].versions[1].endpoints[0].address", "10.0.0.1:8000", 2),
        (DUP_SERVICE, "services[1].name", "- name: llm", 2),
    ],
    ids=["unknown-gpu-class", "duplicate-endpoint", "duplicate-service"],
)
def test_cross_field_errors_name_field_and_line(text, path, needle, nth):
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, needle, nth)}: {path}: "), err


@pytest.mark.parametrize(
    "text",
    [
        MINIMAL.replace("  - name: llm\n", "  - name: llm\n    connect_timeout_s: .inf\n"),
        MINIMAL + "gpu_classes:\n  a100: {capacity: .inf, memory_mib: 81920}\n",
        MINIMAL + "prometheus:\n  window_s: .inf\n",
    ],
    ids=["connect_timeout_s", "gpu-capacity", "window_s"],
)
def test_non_finite_numbers_are_refused(text):
    with pytest.raises(ConfigError):
        parse_config(text)


def test_empty_endpoint_list_is_refused_with_its_path():
    text = MINIMAL.replace("endpoints:\n          - address: 10.0.0.1:8000", "endpoints: []")
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, 'endpoints: []')}: services[0].versions[0].endpoints: ")


def test_missing_services_is_refused():
    err = one_error("engine: {max_weight: 10}\n")
    assert ": services: " in err and "required" in err.lower()


@pytest.mark.parametrize("field", ["version", "cluster", "override_host"])
def test_header_names_must_be_lower_case(field):
    text = MINIMAL + f"headers:\n  {field}: X-Upper\n"
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, 'X-Upper')}: headers.{field}: ")


def test_session_header_list_is_validated():
    text = MINIMAL + "headers:\n  session: [x-ok, 'Bad Header']\n"
    assert ": headers.session: " in one_error(text)


@pytest.mark.parametrize(
    ("section", "value"),
    [("engine:\n  hysteresis", "1.0"), ("engine:\n  stale_after_s", "0"), ("engine:\n  max_weight", "0"),
     ("prometheus:\n  url", "ftp://x"), ("engine:\n  scorers:\n    latency", "-1")],
)
def test_out_of_range_values_are_refused(section, value):
    with pytest.raises(ConfigError):
        parse_config(MINIMAL + f"{section}: {value}\n")


def test_lb_policy_must_be_known():
    text = MINIMAL.replace("  - name: llm\n", "  - name: llm\n    lb_policy: random\n")
    assert one_error(text).startswith(f"cfg.yaml:{line_of(text, 'random')}: services[0].lb_policy: ")


# --- two listeners on one address ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "field", "message", "at"),
    [("listen:\n  xds: 127.0.0.1:18080\n", "listen.ext_proc",   # at its default: the line of listen's first key
      "127.0.0.1:18080 is also the address of listen.xds: each listener needs its own", "xds:"),
     ("listen:\n  admin: 127.0.0.1:018000\n", "listen.admin",
      "127.0.0.1:018000 is also the address of listen.xds: each listener needs its own", "admin:"),
     ("listen:\n  admin: 0.0.0.0:18080\n", "listen.admin",
      "0.0.0.0:18080 and listen.ext_proc (127.0.0.1:18080) share a port and one of them binds every address",
      "admin:"),
     ("metrics:\n  sources: [push]\n  push:\n    listen: 127.0.0.1:18090\n", "metrics.push.listen",
      "127.0.0.1:18090 is also the address of listen.admin", "listen:"),
     ("envoy:\n  listener: 127.0.0.1:18000\n", "envoy.listener",
      "127.0.0.1:18000 is also the address of listen.xds", "listener:"),
     ("node_groups:\n  edge:\n    listener: 127.0.0.1:18090\n", "node_groups.edge.listener",
      "127.0.0.1:18090 is also the address of listen.admin", "listener:")],
)
def test_two_listeners_on_one_address_are_refused(extra, field, message, at):
    text = MINIMAL + extra
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, at)}: {field}: {message}"), err


@pytest.mark.parametrize("listener", ["listen:\n  xds: 10.0.0.1:8000\n", "envoy:\n  listener: 10.0.0.1:8000\n"])
def test_an_endpoint_on_a_listener_of_inferlb_or_envoy_is_refused(listener):
    err = one_error(MINIMAL + listener)
    assert err.startswith(f"cfg.yaml:{line_of(MINIMAL, '10.0.0.1')}: services[0].versions[0].endpoints[0].address: "
                          "10.0.0.1:8000 is the address of "), err
    assert "not of an inference server" in err


@pytest.mark.parametrize("extra", [
    "listen:\n  xds: 127.0.0.1:0\n  ext_proc: 127.0.0.1:0\n  admin: 127.0.0.1:0\n",   # any free port, each
    "listen:\n  admin: 127.0.0.2:18000\n",                                   # another address, same port
    "metrics:\n  push:\n    listen: 127.0.0.1:18090\n",                      # no push source: never bound
    "envoy:\n  listener: 0.0.0.0:18000\nlisten:\n  xds: 10.1.0.1:18000\n",   # Envoy may run on another host
    "node_groups:\n  edge:\n    listener: 127.0.0.1:10000\n",                # the same as envoy.listener
])
def test_listeners_that_do_not_collide_are_accepted(extra):
    parse_config(MINIMAL + extra)


# --- not a config at all --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"), ("", "NoneType")])
def test_not_a_mapping(text, kind):
    err = one_error(text, "file.yaml")
    assert err.startswith("file.yaml: ") and "mapping" in err and kind in err


def test_invalid_yaml_names_the_line():
    text = "services:\n  - name: llm\n    versions: [\n  bad: {\n"
    err = one_error(text, "file.yaml")
    assert re.match(r"^file\.yaml:\d+: not valid YAML", err), err
    assert int(err.split(":")[1]) >= 3


def test_a_key_given_twice_is_refused_with_both_lines():
    """PyYAML keeps the last of two equal keys silently; the config names each repeat instead."""
    text = MINIMAL + "loop:\n  interval_s: 1\nloop:\n  interval_s: 2\n"
    twice = MINIMAL.replace("  - name: llm\n", "  - name: llm\n    name: llm2\n")
    err = one_error(text, "file.yaml")
    assert err == f"file.yaml:{text.count(chr(10)) - 1}: loop: given twice in one mapping (YAML keys are unique)"
    assert one_error(twice).endswith("name: given twice in one mapping (YAML keys are unique)")
    merged = MINIMAL + "x-base: &base {interval_s: 2}\nloop:\n  <<: *base\n  interval_s: 3\n"
    assert "given twice" not in one_error(merged)  # a merge key is not a key (x-base is refused as unknown)


def test_a_config_nested_too_deeply_is_a_config_error():
    assert one_error("services: " + "[" * 5000 + "]" * 5000, "file.yaml") == \
        "file.yaml: the config nests too deeply to read"


def test_a_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b'services:\n  - name: "\xff\xfe"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:2: not UTF-8 text (byte 0xff); a YAML config must be UTF-8"


def test_load_config_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_load_config_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    text = MINIMAL.replace("10.0.0.1:8000", "host.example:8000")
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    where = f"{path}:{line_of(text, 'host.example')}: services[0].versions[0].endpoints[0].address: "
    assert str(info.value).startswith(where)


def test_loop_section_and_its_deprecated_prometheus_spelling(caplog):
    new = parse_config("loop: {interval_s: 2, timeout_s: 0.5}\nservices: [{name: chat, versions: [{name: v1, "
                       "endpoints: [{address: '127.0.0.1:8001'}]}]}]\n")
    assert (new.loop.interval_s, new.loop.timeout_s, new.loop.first_round_wait_s) == (2, 0.5, 10.0)
    with caplog.at_level("WARNING"):
        old = parse_config("prometheus: {interval_s: 2, timeout_s: 0.5}\nservices: [{name: chat, versions: "
                           "[{name: v1, endpoints: [{address: '127.0.0.1:8001'}]}]}]\n", "old.yaml")
    assert old.loop == new.loop
    assert "old.yaml: prometheus.interval_s is deprecated; use loop.interval_s" in caplog.text
    with pytest.raises(ConfigError, match="prometheus.interval_s and loop.interval_s are both set"):
        parse_config("loop: {interval_s: 1}\nprometheus: {interval_s: 2}\nservices: []\n")


@pytest.mark.parametrize("loop", ["loop: {interval_s: 1}\n", "loop: {interval_s: 0.5, timeout_s: 1}\n",
                                  "prometheus: {interval_s: 1}\n"])
def test_a_loop_timeout_longer_than_its_interval_is_accepted(loop):
    # rounds never overlap (tests/unit/xds_server/test_control_loop.py): lowering interval_s below the
    # default timeout_s (2 s) needs no timeout_s
    cfg = parse_config(MINIMAL + loop)
    assert cfg.loop.timeout_s > cfg.loop.interval_s


# --- staleness against the sources' own intervals (issue 15 item 11) -------------------------------


@pytest.mark.parametrize(("extra", "source"), [
    ("metrics:\n  sources: [scrape]\n  scrape: {interval_s: 20}\n", "metrics.scrape.interval_s (20 s)"),
    ("metrics:\n  fallback: scrape\n  scrape: {interval_s: 20}\n", "metrics.scrape.interval_s (20 s)"),
    ("prometheus:\n  scrape_interval_s: 20\n", "prometheus.scrape_interval_s (20 s)"),
])
def test_staleness_shorter_than_two_sample_intervals_is_refused_with_field_and_line(extra, source):
    text = MINIMAL + "engine:\n  stale_after_s: 15\n" + extra
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, 'stale_after_s')}: engine.stale_after_s: "), err
    assert source in err and "= 40 s" in err and "flap" in err


def test_staleness_of_two_sample_intervals_is_accepted():
    cfg = parse_config(MINIMAL + "engine:\n  stale_after_s: 40\nprometheus:\n  scrape_interval_s: 20\n"
                       "metrics:\n  sources: [prometheus, scrape]\n  scrape: {interval_s: 20}\n")
    assert cfg.engine.stale_after_s == 40 and cfg.prometheus.scrape_interval_s == 20


def test_a_window_shorter_than_two_sample_intervals_is_refused_with_field_and_line():
    text = MINIMAL + "engine:\n  stale_after_s: 40\nprometheus:\n  window_s: 15\n  scrape_interval_s: 15\n"
    err = one_error(text)
    assert err.startswith(f"cfg.yaml:{line_of(text, 'window_s')}: prometheus.window_s: "), err
    assert "2 x prometheus.scrape_interval_s (15 s)" in err
    assert parse_config(text.replace("window_s: 15", "window_s: 30")).prometheus.window_s == 30


def with_endpoint_keys(*lines: str) -> str:
    """MINIMAL with ``lines`` (YAML ``key: value``) added to its one endpoint."""
    first = "- address: 10.0.0.1:8000\n"
    indent = " " * (MINIMAL.split(first)[0].rsplit("\n", 1)[1].__len__() + 2)
    return MINIMAL.replace(first, first + "".join(f"{indent}{line}\n" for line in lines))


@pytest.mark.parametrize(("endpoint", "problem"), [
    ("max_concurrency: true", "max_concurrency: Value error, expected a number, got true"),
    ("gpu_memory_mib: false", "gpu_memory_mib: Value error, expected a number, got false"),
    ('drain: "yes"', "drain: Value error, expected true or false, got 'yes'"),
    ("drain: 0", "drain: Value error, expected true or false, got 0"),
    ("max_concurrency: 99999999999999999999", "max_concurrency: Input should be less than or equal to 1000000"),
    ("gpu_memory_mib: 1.0e+30", "gpu_memory_mib: Input should be less than or equal to 16777216"),
])
def test_a_typo_in_a_number_or_a_switch_is_refused(endpoint, problem):
    """pydantic's lax mode would read true as 1 and "yes" or 0 as a switch; a value past any real node is a typo."""
    text = with_endpoint_keys(endpoint)
    assert one_error(text) == f"cfg.yaml:{text.count(chr(10))}: services[0].versions[0].endpoints[0].{problem}"


def test_a_real_switch_and_number_still_read():
    text = with_endpoint_keys("drain: true", "max_concurrency: 256", "gpu_memory_mib: 81920")
    e = parse_config(text).services[0].versions[0].endpoints[0]
    assert (e.drain, e.max_concurrency, e.gpu_memory_mib) == (True, 256, 81920.0)


@pytest.mark.parametrize("hosts", ["[]", "['']", "['.']", "[' ']", "['api.example', '']"])
def test_a_service_without_a_host_name_is_refused_naming_its_hosts(hosts):
    text = MINIMAL.replace("  - name: llm\n", f"  - name: llm\n    hosts: {hosts}\n", 1)
    assert "hosts:" in text
    err = one_error(text)
    assert "services[0].hosts" in err and ("host" in err), err


@pytest.mark.parametrize("picker,refused", [
    ("{admission: true, queue_timeout_s: 0.5}", True),
    ("{memory_queue: true, queue_timeout_s: 0.5}", True),   # the memory queue holds requests as long
    ("{queue_timeout_s: 0.5}", False),                      # nothing queues: the timeout is never used
    ("{memory_queue: true, queue_timeout_s: 0.2}", False),
])
def test_a_queue_timeout_envoy_would_not_wait_for_is_refused_whenever_requests_queue(picker, refused):
    text = f"picker: {picker}\n" + MINIMAL
    if refused:
        assert "picker.queue_timeout_s (0.5) must be below envoy.ext_proc_timeout_s (0.25)" in one_error(text)
    else:
        parse_config(text)


@pytest.mark.parametrize("headers,role", [
    ("{version: x-session-id}", "version"),
    ("{override_host: model-version}", "override_host"),
    ("{session: [x-a, x-a]}", "session"),
])
def test_a_header_given_two_roles_is_refused(headers, role):
    err = one_error(f"headers: {headers}\n" + MINIMAL)
    assert "headers" in err and "each header has one role" in err, err


@pytest.mark.parametrize(("host", "says"), [
    ("*.example.com", "the only wildcard"), ("api.*", "the only wildcard"), ("gw.local:10000", "without its port"),
    ("::1", "in brackets"), ("[::1]:8080", "without its port"), ("api example", "not a host name"),
    ("http://api.example", "without its port"), ("api/v1", "not a host name"),
])
def test_a_host_the_picker_could_never_match_is_refused(host, says):
    # Envoy's route took '*.example.com' and 'gw.local:10000' (its domains), while the picker matches the
    # request's host name alone: every inference request got the picker's 404 unknown_service.
    text = MINIMAL.replace("  - name: llm\n", f"  - name: llm\n    hosts: [{host!r}]\n", 1)
    err = one_error(text)
    assert "services[0].hosts" in err and says in err, err


@pytest.mark.parametrize("host", ["*", "api.example.com", "API.Example.COM.", "10.0.0.1", "[::1]", "[fe80::1]",
                                  "my_host-1"])
def test_names_addresses_and_the_any_host_are_accepted(host):
    text = MINIMAL.replace("  - name: llm\n", f"  - name: llm\n    hosts: [{host!r}]\n", 1)
    assert parse_config(text).services[0].hosts == (host,)


def test_hosts_that_differ_only_by_case_or_a_trailing_dot_are_one_host():
    text = MINIMAL + "  - name: two\n    hosts: ['API.Example.']\n    versions:\n      - name: v1\n" \
                     "        endpoints: [{address: '10.0.0.2:8000'}]\n"
    text = text.replace("  - name: llm\n", "  - name: llm\n    hosts: [api.example]\n", 1)
    assert "host 'API.Example.' is already taken by service 'llm'" in one_error(text)
