"""The real grpc.aio ext_proc server, spoken to by a real grpc.aio client stub."""

from __future__ import annotations

import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import REGISTRY

from ext_proc.handler import PickerHandler
from ext_proc.transport.grpcio import start_ext_proc_server
from ext_proc.view import RoutingTable, ServiceRoute, ViewHolder

OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
ENDPOINTS = {f"10.0.0.{i}:8000" for i in range(3)}


def assignment(name: str) -> endpoint_pb2.ClusterLoadAssignment:
    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    locality = cla.endpoints.add()
    for i in range(3):
        lb = locality.lb_endpoints.add(health_status=health_check_pb2.HEALTHY)
        lb.endpoint.address.socket_address.address = f"10.0.0.{i}"
        lb.endpoint.address.socket_address.port_value = 8000
    return cla


def headers_request(**headers: str | bytes) -> pb.ProcessingRequest:
    """A request-headers message as Envoy sends it: values in raw_value, value empty."""
    values = {":authority": b"api.example.com:10000", ":method": b"POST", ":path": b"/v1/chat"}
    values.update(
        {k.replace("_", "-"): v if isinstance(v, bytes) else v.encode() for k, v in headers.items()}
    )
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in values.items()]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=True))


def counter(name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
               if sample.name == name and labels.items() <= sample.labels.items())


@pytest.fixture
async def holder():
    h = ViewHolder()
    routing = RoutingTable(
        services=(ServiceRoute("llm", ("api.example.com",), "v1", {"v1": "llm-v1", "v2": "llm-v2"}, affinity="soft"),)
    )
    h.update({"llm-v1": assignment("llm-v1"), "llm-v2": assignment("llm-v2")}, routing)
    return h


@pytest.fixture
async def handler(holder):
    return PickerHandler(holder)


@pytest.fixture
async def stub(holder, handler):
    server, port = await start_ext_proc_server(handler, "127.0.0.1:0")
    assert port > 0
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await server.stop(None)


async def exchange(stub, *requests: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    call = stub.Process(iter(requests), timeout=5)
    responses = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    return responses


def set_headers(response: pb.ProcessingResponse) -> dict[str, bytes]:
    mutation = response.request_headers.response.header_mutation
    for option in mutation.set_headers:
        assert option.append_action == OVERWRITE
        assert option.header.value == "", "header written into value: Envoy would set it empty"
    return {o.header.key: o.header.raw_value for o in mutation.set_headers}


async def test_session_request_sets_cluster_and_override_host(stub, handler):
    before = counter("inferlb_ext_proc_decisions_total", outcome="affinity")
    by_ring = counter("inferlb_ext_proc_decisions_total", outcome="affinity", plugins="prefix-cache")
    [response] = await exchange(stub, headers_request(model_version="v2", x_session_id="alice"))
    assert response.WhichOneof("response") == "request_headers"
    assert response.request_headers.response.clear_route_cache is True
    got = set_headers(response)
    assert set(got) == {"x-inferlb-cluster", "x-gateway-destination-endpoint"}
    assert got["x-inferlb-cluster"] == b"llm-v2"
    assert got["x-gateway-destination-endpoint"].decode() in ENDPOINTS
    # Sticky across streams (once the first request completed: it no longer weighs on its endpoint).
    handler.control.inflight.completed("llm-v2", got["x-gateway-destination-endpoint"].decode())
    [again] = await exchange(stub, headers_request(model_version="v2", x_session_id="alice"))
    assert set_headers(again) == got
    assert counter("inferlb_ext_proc_decisions_total", outcome="affinity") == before + 2
    # The plugins that decided: the default profile's picker kept the key's endpoint, then the pin.
    assert counter("inferlb_ext_proc_decisions_total", outcome="affinity", plugins="prefix-cache") == by_ring + 2


async def test_a_request_without_session_is_pinned_too(stub):
    [response] = await exchange(stub, headers_request())
    got = set_headers(response)
    assert got["x-inferlb-cluster"] == b"llm-v1" and got["x-gateway-destination-endpoint"].decode() in ENDPOINTS
    assert response.request_headers.response.clear_route_cache is True
    assert not response.request_headers.response.header_mutation.remove_headers


async def test_forged_override_host_is_overwritten_when_pinning(stub):
    forged = headers_request(x_gateway_destination_endpoint="169.254.169.254:80", x_inferlb_cluster="admin")
    [response] = await exchange(stub, forged)
    got = set_headers(response)
    assert got["x-inferlb-cluster"] == b"llm-v1" and got["x-gateway-destination-endpoint"].decode() in ENDPOINTS


async def test_forged_override_host_is_removed_when_not_pinning():
    h = ViewHolder()
    routing = RoutingTable(services=(ServiceRoute("llm", ("api.example.com",), "v1", {"v1": "llm-v1"},
                                                  affinity="soft"),))
    h.update({"llm-v1": endpoint_pb2.ClusterLoadAssignment(cluster_name="llm-v1")}, routing)  # no endpoint
    server, port = await start_ext_proc_server(PickerHandler(h), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            forged = headers_request(x_gateway_destination_endpoint="169.254.169.254:80", x_inferlb_cluster="admin")
            [response] = await exchange(pb_grpc.ExternalProcessorStub(channel), forged)
    finally:
        await server.stop(None)
    assert set_headers(response) == {"x-inferlb-cluster": b"llm-v1"}
    assert list(response.request_headers.response.header_mutation.remove_headers) == [
        "x-gateway-destination-endpoint"
    ]


async def test_unknown_version_is_an_immediate_400(stub):
    before = counter("inferlb_ext_proc_decisions_total", outcome="unknown-version")
    [response] = await exchange(stub, headers_request(model_version="v9", x_session_id="alice"))
    assert response.WhichOneof("response") == "immediate_response"
    immediate = response.immediate_response
    assert immediate.status.code == 400
    assert immediate.details == "inferlb_unknown_version"
    error = json.loads(immediate.body)["error"]["message"]
    assert "'v9'" in error and "known versions: v1, v2" in error
    content_type = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert content_type == {"content-type": b"application/json"}
    assert counter("inferlb_ext_proc_decisions_total", outcome="unknown-version") == before + 1


async def test_value_field_is_read_when_raw_value_is_empty(stub):
    request = headers_request()
    request.request_headers.headers.headers.add(key="model-version", value="v2")
    [response] = await exchange(stub, request)
    assert set_headers(response)["x-inferlb-cluster"] == b"llm-v2"


async def test_other_phases_get_an_empty_matching_answer(stub):
    before = counter("inferlb_ext_proc_errors_total", kind="unexpected-request-body")
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    trailers = pb.ProcessingRequest(response_trailers=pb.HttpTrailers())
    responses = await exchange(stub, body, trailers, headers_request())
    assert [r.WhichOneof("response") for r in responses] == [
        "request_body",
        "response_trailers",
        "request_headers",
    ]
    assert responses[0].request_body == pb.BodyResponse()
    assert counter("inferlb_ext_proc_errors_total", kind="unexpected-request-body") == before + 1


async def test_undecodable_message_ends_the_stream_with_an_error_and_is_counted(holder):
    server, port = await start_ext_proc_server(PickerHandler(holder), "127.0.0.1:0")
    before = counter("inferlb_ext_proc_errors_total", kind="decode")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            process = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=lambda b: b,
                response_deserializer=pb.ProcessingResponse.FromString,
            )
            call = process(iter([b"\xff\xff\xff\xff"]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in call]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # The server is still fine.
            [response] = await exchange(pb_grpc.ExternalProcessorStub(channel), headers_request())
            assert set_headers(response)["x-inferlb-cluster"] == b"llm-v1"
    finally:
        await server.stop(None)
    assert counter("inferlb_ext_proc_errors_total", kind="decode") == before + 1


async def test_not_ready_view_passes_through():
    server, port = await start_ext_proc_server(PickerHandler(ViewHolder()), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            [response] = await exchange(pb_grpc.ExternalProcessorStub(channel), headers_request())
        assert response == pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    finally:
        await server.stop(None)


async def test_binding_a_taken_port_fails(holder):
    server, port = await start_ext_proc_server(PickerHandler(holder), "127.0.0.1:0")
    try:
        with pytest.raises(RuntimeError):
            await start_ext_proc_server(PickerHandler(holder), f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


async def test_picker_failure_ends_the_stream_with_an_error_and_is_counted():
    broken = ViewHolder()
    broken.current = None  # a bug upstream: pick() raises on it
    server, port = await start_ext_proc_server(PickerHandler(broken), "127.0.0.1:0")
    before = counter("inferlb_ext_proc_errors_total", kind="pick-failed")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(iter([headers_request()]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [r async for r in call]
            assert info.value.code() == grpc.StatusCode.INTERNAL
    finally:
        await server.stop(None)
    assert counter("inferlb_ext_proc_errors_total", kind="pick-failed") == before + 1


async def test_cached_answers_follow_forged_headers_and_view_swaps(stub, holder):
    plain, forged = headers_request(), headers_request(x_gateway_destination_endpoint="10.9.9.9:1")
    for request in (plain, forged, plain):
        [response] = await exchange(stub, request)
        got = set_headers(response)
        assert got["x-inferlb-cluster"] == b"llm-v1" and got["x-gateway-destination-endpoint"].decode() in ENDPOINTS
        assert not response.request_headers.response.header_mutation.remove_headers
    # A new view with other header names and versions applies to the very next request.
    routing = RoutingTable(
        cluster_header="x-route-to",
        services=(ServiceRoute("llm", ("*",), "v3", {"v3": "llm-v3"}, affinity="soft"),),
    )
    holder.update({"llm-v3": assignment("llm-v3")}, routing)
    [response] = await exchange(stub, plain)
    assert set_headers(response)["x-route-to"] == b"llm-v3"


async def test_grpcio_sends_every_answer_of_a_full_duplex_body_in_order():
    """The endpoint-picker protocol (picker.protocol: gateway-api) answers the body's last chunk with
    the deferred headers answer and the body sent back: two messages for one (ext_proc.gateway)."""
    from tests.unit.ext_proc.test_gateway_protocol import body_msg, chat, handler, headers_msg

    server, port = await start_ext_proc_server(handler(), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            requests = [pb.ProcessingRequest.FromString(m) for m in (headers_msg(), body_msg(chat(), True))]
            responses = await exchange(pb_grpc.ExternalProcessorStub(channel), *requests)
    finally:
        await server.stop(None)
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
    assert responses[1].request_body.response.body_mutation.streamed_response.body == chat()
