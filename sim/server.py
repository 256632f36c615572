"""aiohttp HTTP front of a simulated backend.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
``GET /v1/models/{model}``), ``GET /health``, ``GET /metrics``, ``POST /sim/fault`` (see
:mod:`sim.faults`), ``GET /sim/state``, ``GET /sim/spans?since=T`` (:meth:`sim.node.SimNode.spans_since`).
Every response carries ``x-served-by: HOST:PORT`` and ``x-backend-version: VERSION``.
``"stream": true`` answers Server-Sent Events (``text/event-stream``): the response starts with the
first token (so a request refused for memory still gets its HTTP 500), then one chunk per token as
the node produces them, a last chunk with the finish reason, the usage chunk when
``stream_options.include_usage`` is set, and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing

from aiohttp import web

from sim.config import BackendConfig
from sim.engines.api import FAIL_OOM
from sim.etcd import EtcdRegistration
from sim.faults import FaultError, parse_fault_patch
from sim.metrics import CONTENT_TYPE
from sim.node import EngineRefused, NodeClosing, SimNode
from sim.protocol import (
    Kind,
    RequestError,
    chunk_body,
    completion_body,
    error_body,
    load_json,
    model_body,
    model_list_body,
    parse_request,
    sse,
    usage_body,
    usage_chunk,
)
from sim.push import push_status

log = logging.getLogger("inferlb.sim")

NODE_KEY = web.AppKey("inferlb_sim_node", SimNode)
STARTED_KEY = web.AppKey("inferlb_sim_started", int)
TASKS_KEY = web.AppKey("inferlb_sim_tasks", list)
ETCD_KEY = web.AppKey("inferlb_sim_etcd", EtcdRegistration)
MAX_BODY_BYTES = 64 * 1024 * 1024  # the largest request body a simulated backend reads (bytes)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def get_node(app: web.Application) -> SimNode:
    """The :class:`SimNode` behind an app made by :func:`make_app`."""
    return app[NODE_KEY]


def format_address(host: str, port: int) -> str:
    """``HOST:PORT`` as reported in ``x-served-by`` (IPv6 hosts in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _json_error(status: int, message: str, err_type: str, param: str | None = None,
                code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, err_type, param, code), status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's HTTP errors (404, 405, 413 ...) and unexpected exceptions into JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(exc.status, exc.reason, "http_error")
    except asyncio.CancelledError:
        raise
    except Exception:  # never let a bug take the server down
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _json_error(500, "internal simulator error", "internal_error")


async def _inference(request: web.Request, kind: Kind) -> web.StreamResponse:
    response = await _answer(request, kind)
    get_node(request.app).metrics.observe_http(request.path, response.status)
    return response


async def _answer(request: web.Request, kind: Kind) -> web.StreamResponse:
    node = get_node(request.app)
    try:
        req = parse_request(kind, await request.read(), request.headers)
    except RequestError as exc:
        node.counters["bad_requests"] += 1
        return _json_error(400, str(exc), "invalid_request_error", exc.field)
    job = node.new_job(req)
    created = int(time.time())
    name = node.cfg.model_name
    async with aclosing(node.generate(job)) as tokens:
        try:
            first = await anext(tokens)
        except EngineRefused as exc:
            if exc.reason == FAIL_OOM:
                return _json_error(500, str(exc), "oom")
            return _json_error(400, str(exc), "invalid_request_error", "messages" if kind == "chat" else "prompt")
        except NodeClosing as exc:
            return _json_error(503, str(exc), "unavailable")
        if not req.stream:
            async for _ in tokens:
                pass
            done = node.completion(job)
            return web.json_response(completion_body(
                req, request_id=done.request_id, model_name=name, text=done.text, created=created,
                finish_reason=done.finish_reason, completion_tokens=done.completion_tokens,
                cached_tokens=done.cached_tokens))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0

        def chunks(n: int) -> bytes:
            nonlocal sent
            out = []
            for i in range(sent, sent + n):
                out.append(sse(chunk_body(req, request_id=job.request_id, model_name=name, created=created,
                                          text=job.token_text(i), role=i == 0)))
            sent += n
            return b"".join(out)

        await response.write(chunks(first))
        async for n in tokens:
            await response.write(chunks(n))
    tail = [sse(chunk_body(req, request_id=job.request_id, model_name=name, created=created, text="",
                           finish_reason=job.finish_reason))]
    if req.include_usage:
        done = node.completion(job)
        tail.append(sse(usage_chunk(req, request_id=job.request_id, model_name=name, created=created,
                                    usage=usage_body(done.prompt_tokens, done.completion_tokens,
                                                     done.cached_tokens))))
    tail.append(sse("[DONE]"))
    await response.write(b"".join(tail))
    await response.write_eof()
    return response


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _inference(request, "chat")


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _inference(request, "completion")


async def _models(request: web.Request) -> web.Response:
    return web.json_response(model_list_body(get_node(request.app).cfg.model_name, request.app[STARTED_KEY]))


async def _model(request: web.Request) -> web.Response:
    name, wanted = get_node(request.app).cfg.model_name, request.match_info["model"]
    if wanted != name:
        return _json_error(404, f"The model '{wanted}' does not exist; this backend serves '{name}'",
                           "invalid_request_error", "model", code="model_not_found")
    return web.json_response(model_body(name, request.app[STARTED_KEY]))


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _metrics(request: web.Request) -> web.Response:
    node = get_node(request.app)
    faults = node.faults
    await faults.wait_while(lambda: faults.metrics == "hang")
    if faults.closing or faults.metrics == "error":
        return web.Response(status=503, text="metrics unavailable (simulated fault)\n")
    return web.Response(body=node.metrics.render(node.gauges()), headers={"Content-Type": CONTENT_TYPE})


async def _set_fault(request: web.Request) -> web.Response:
    node = get_node(request.app)
    raw = await request.read()
    try:
        patch = parse_fault_patch(load_json(raw) if raw.strip() else None)
    except (RequestError, FaultError) as exc:
        return _json_error(400, str(exc), "invalid_request_error", exc.field)
    node.apply_faults(patch)
    log.info("%s faults now %s", node.served_by, node.faults.as_dict())
    return web.json_response({"faults": node.faults.as_dict()})


async def _state(request: web.Request) -> web.Response:
    return web.json_response(get_node(request.app).state())


async def _spans(request: web.Request) -> web.Response:
    raw = request.query.get("since", "0")
    try:
        since = float(raw)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        return _json_error(400, f"query parameter 'since' must be a finite number of seconds, got '{raw[:40]}'",
                           "invalid_request_error", "since")
    return web.json_response({"spans": get_node(request.app).spans_since(since)})


def make_app(cfg: BackendConfig) -> web.Application:
    """Build the aiohttp application of one simulated backend (not yet listening)."""
    node = SimNode(cfg)
    # vLLM's server (uvicorn) sets no body limit; aiohttp's default is 1 MiB: long prompts are larger.
    app = web.Application(middlewares=[_errors_as_json], client_max_size=MAX_BODY_BYTES)
    app[NODE_KEY] = node

    async def add_identity_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-served-by"] = node.served_by
        response.headers["x-backend-version"] = cfg.version

    async def release_held_requests(app: web.Application) -> None:
        node.faults.close()

    async def stop_tasks(app: web.Application) -> None:
        for task in app[TASKS_KEY]:
            task.cancel()
        node.close_kv_events()

    async def open_kv_events(app: web.Application) -> None:
        node.open_kv_events()

    app[TASKS_KEY] = []
    app[STARTED_KEY] = int(time.time())
    app.on_response_prepare.append(add_identity_headers)
    app.on_startup.append(open_kv_events)
    app.on_shutdown.append(release_held_requests)
    app.on_cleanup.append(stop_tasks)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/sim/fault", _set_fault)
    app.router.add_get("/sim/state", _state)
    app.router.add_get("/sim/spans", _spans)
    return app


async def start_backend(cfg: BackendConfig, *, shutdown_timeout: float = 2.0) -> tuple[web.AppRunner, int]:
    """Start a backend in the running loop; returns ``(runner, bound_port)``.

    ``cfg.port=0`` picks a free port. Stop it with ``await runner.cleanup()``. A client that
    disconnects cancels its request (memory and running slot are released).
    """
    app = make_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    node = get_node(app)
    node.bind(format_address(cfg.host, port))
    if cfg.push_status:
        app[TASKS_KEY].append(asyncio.create_task(
            push_status(node, cfg.push_status, cfg.push_interval_s, cfg.push_instance or node.served_by)))
    if cfg.etcd:
        reg = EtcdRegistration(node, cfg.etcd, prefix=cfg.etcd_prefix, ttl_s=cfg.etcd_ttl_s,
                               service=cfg.etcd_service or cfg.model_name,
                               address=cfg.etcd_address or node.served_by,
                               status_interval_s=cfg.etcd_status_interval_s, drain_s=cfg.etcd_drain_s,
                               user=cfg.etcd_user)
        app[ETCD_KEY] = reg
        reg.task = asyncio.create_task(reg.run())
        app[TASKS_KEY].append(reg.task)
    return runner, port


async def deregister(runner: web.AppRunner) -> None:
    """Graceful leave of an etcd-registered backend (no-op without ``--etcd``): stop the keep-alives,
    announce drain, keep serving ``etcd_drain_s`` s, revoke the lease. Call before ``runner.cleanup()``."""
    reg = runner.app.get(ETCD_KEY)
    if reg is None:
        return
    if reg.task is not None:
        reg.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reg.task
    await reg.deregister()


async def _serve_forever(cfg: BackendConfig) -> None:
    runner, port = await start_backend(cfg)
    node = get_node(runner.app)
    print(
        f"sim backend {node.cfg.model_name} {cfg.version} ({cfg.engine} engine, {cfg.gpu_class}) listening on "
        f"{node.served_by}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await deregister(runner)
    finally:
        await runner.cleanup()


def run_backend(cfg: BackendConfig) -> None:
    """Run one backend until SIGINT/SIGTERM (blocking)."""
    asyncio.run(_serve_forever(cfg))
