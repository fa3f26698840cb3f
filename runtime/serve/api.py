"""The OpenAI-compatible HTTP API on aiohttp.

    POST /v1/chat/completions   stream or not; errors as OpenAI's {"error": {...}} with a 4xx code
    GET  /v1/models             the loaded model
    GET  /health                200 once warm, 503 before (and while shutting down)
    GET  /metrics               Prometheus text

``state`` is the service (runtime/serve/service.py): ``config`` (the current Config, replaced on SIGHUP),
``scheduler``, ``metrics``, ``ready`` and ``model_name``. Bodies are read here with the configured size
limit and read timeout (a slow client is dropped), never decompressed (a gzip bomb is refused as 415),
decoded as strict UTF-8 and parsed as JSON before anything is queued.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid

from aiohttp import HttpVersion11, web

from .openai_schema import BadRequest, chunk, completion, error_body, finish_reason, parse_chat_request, usage
from .scheduler import AsyncJob, PromptTooLong, QueueFull, ShuttingDown

log = logging.getLogger(__name__)
STATE = web.AppKey("state", object)
PATHS = {"/v1/chat/completions", "/v1/models", "/health", "/metrics"}
OPEN_PATHS = {"/health"}  # answered without the API key (a load balancer's probe)


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None):
    return web.json_response(error_body(message, kind, param), status=status, headers=headers)


def _auth_error(request: web.Request, state) -> web.Response | None:
    """401 unless the request carries the API key (when one is set): 'Authorization: Bearer KEY', the scheme
    in any case (RFC 7235); compared in constant time, as bytes (a header that is not UTF-8 arrives with
    surrogate escapes: it is a wrong key, not a crash)."""
    key = state.config.api.api_key
    if not key or request.path in OPEN_PATHS:
        return None
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"),
                                                           key.encode("utf-8")):
        return None
    return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error",
                  headers={"WWW-Authenticate": "Bearer"})


async def _expect(request: web.Request):
    """'Expect: 100-continue': refuse a wrong key or a too-large Content-Length before the client sends the
    body (aiohttp answers 100 Continue before any middleware runs); otherwise 100 Continue."""
    state = request.app[STATE]
    limit = state.config.api.body_limit_kib * 1024
    resp = _auth_error(request, state)
    if resp is None and request.content_length is not None and request.content_length > limit:
        resp = _error(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}")
    if resp is not None:
        resp.force_close()
        state.metrics.requests.inc(1, request.path if request.path in PATHS else "other", str(resp.status))
        return resp
    if request.version != HttpVersion11:
        return None
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers.get('Expect', ''):.100}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # as aiohttp's default expect handler
    request.writer.output_size = 0  # the body's size counts from here
    return None


@web.middleware
async def _guard(request: web.Request, handler):
    """Auth, JSON errors for everything, a count per request; nothing a client sends escapes as a crash."""
    state = request.app[STATE]
    path = request.path if request.path in PATHS else "other"
    resp = None
    try:
        resp = _auth_error(request, state)
        if resp is not None:
            return resp
        resp = await handler(request)
        return resp
    except web.HTTPException as e:
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        resp = _error(e.status, e.reason if e.status != 404 else f"no route {request.method} {request.path:.100}",
                      kind, headers={k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")})
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - a bug answers 500, logged; the service keeps serving
        log.exception("%s %s failed", request.method, path)
        resp = _error(500, "internal error (see the service log)", "server_error")
        return resp
    finally:
        code = str(resp.status) if resp is not None else "disconnected"
        state.metrics.requests.inc(1, path, code)


async def _read_json(request: web.Request, api):
    """The body as JSON, or a 4xx: 413 too large, 415 compressed, 408 too slow, 400 not UTF-8 / not JSON."""
    limit = api.body_limit_kib * 1024
    if request.headers.get("Content-Encoding", "identity").lower() not in ("identity", ""):
        raise _Reply(_error(415, "compressed request bodies are not accepted"))
    if request.content_length is not None and request.content_length > limit:
        raise _Reply(_error(413, f"request body of {request.content_length} bytes exceeds the limit of {limit}"))

    async def read() -> bytes:
        buf = bytearray()
        async for part in request.content.iter_any():
            buf += part
            if len(buf) > limit:
                raise _Reply(_error(413, f"request body exceeds the limit of {limit} bytes"))
        return bytes(buf)

    try:
        raw = await asyncio.wait_for(read(), api.read_timeout_s)
    except asyncio.TimeoutError:
        raise _Reply(_error(408, f"request body not received within {api.read_timeout_s:g} s")) from None
    except ConnectionError:  # the client went away mid-body (a truncated request): nobody to answer
        raise _Reply(_error(400, "connection lost while reading the request body")) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Reply(_error(400, f"request body is not UTF-8 (byte {e.start})")) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _Reply(_error(400, f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}")) from None
    except RecursionError:
        raise _Reply(_error(400, "malformed JSON: nested too deeply")) from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() (4300) digits
        raise _Reply(_error(400, "malformed JSON: a number has too many digits")) from None


class _Reply(Exception):
    """A response to return at once (an error found while reading the request)."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    api = state.config.api
    if not state.ready:
        return _error(503, "the model is still loading", "server_error", headers={"Retry-After": "1"})
    try:
        body = await _read_json(request, api)
        req = parse_chat_request(body, max_tokens_cap=api.max_tokens, system_prompt=state.config.model.system_prompt)
    except _Reply as r:
        return r.response
    except BadRequest as e:
        return _error(400, str(e), param=e.param)
    except ValueError as e:  # GenerationConfig's own checks
        return _error(400, str(e))
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    job = AsyncJob(req.messages, req.config, "api", loop=asyncio.get_running_loop(), job_id=rid)
    try:
        state.scheduler.submit(job)
    except QueueFull as e:
        return _error(503, str(e), "server_error", headers={"Retry-After": str(e.retry_after_s)})
    except ShuttingDown as e:
        return _error(503, str(e), "server_error")
    try:
        kind, value = await job.next()
        if kind == "error":
            return _job_error(value)
        if req.stream:
            return await _stream(request, job, req, state.model_name)
        parts = []
        while True:
            kind, value = await job.next()
            if kind == "delta":
                parts.append(value)
            elif kind == "error":
                return _job_error(value)
            else:
                break
        if value.finish_reason == "cancelled":
            return _error(503, "the request was cancelled (the service is shutting down)", "server_error")
        return web.json_response(completion(rid, state.model_name, "".join(parts), value))
    finally:
        if not job.done.is_set():
            job.request_cancel("disconnect")  # the handler was cancelled (client gone) or failed


def _job_error(e: Exception) -> web.Response:
    if isinstance(e, PromptTooLong):
        return _error(400, str(e), param="messages", headers=None)
    if isinstance(e, ShuttingDown):
        return _error(503, str(e), "server_error")
    if isinstance(e, ValueError):
        return _error(400, str(e))
    return _error(500, "internal error (see the service log)", "server_error")


async def _stream(request: web.Request, job: AsyncJob, req, model_name: str) -> web.StreamResponse:
    """SSE chunks until ``data: [DONE]``; a client that goes away ends it quietly (the caller cancels the job)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        return await _stream_events(resp, job, req, model_name)
    except ConnectionError:  # aiohttp's ClientConnectionResetError: the client hung up mid-stream
        log.debug("%s: client gone mid-stream", job.id)
        return resp


async def _stream_events(resp: web.StreamResponse, job: AsyncJob, req, model_name: str) -> web.StreamResponse:
    created = int(time.time())

    async def send(obj) -> None:
        await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    await send(chunk(job.id, model_name, created, {"role": "assistant", "content": ""}))
    while True:
        kind, value = await job.next()
        if kind == "delta":
            await send(chunk(job.id, model_name, created, {"content": value}))
        elif kind == "error":
            await send(error_body(str(value), "server_error"))
            return resp
        else:
            break
    if value.finish_reason == "cancelled":
        await send(error_body("the request was cancelled (the service is shutting down)", "server_error"))
        return resp
    await send(chunk(job.id, model_name, created, {}, finish_reason(value.finish_reason)))
    if req.include_usage:
        last = chunk(job.id, model_name, created, {})
        last["choices"] = []
        last["usage"] = usage(value)
        await send(last)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": state.started_at, "owned_by": "boardtalk"}]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = {"status": "ok" if state.ready else ("stopping" if state.stopping else "loading"),
            "queue": state.scheduler.depth if state.scheduler else 0}
    return web.json_response(body, status=200 if state.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[STATE].metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def make_app(state) -> web.Application:
    # client_max_size guards aiohttp's own readers; ours (_read_json) applies the configured, reloadable limit
    app = web.Application(middlewares=[_guard], client_max_size=state.config.api.body_limit_kib * 1024)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=_expect)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def header_timeout_s(api) -> float:
    """Seconds a connection may take to send a request's headers, and may stay idle between requests."""
    return max(5.0, api.read_timeout_s)


async def start_api(state, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Listen; returns the runner (``await runner.cleanup()`` stops it) and the bound port."""
    # keepalive_timeout also bounds a new connection that never completes its request line and headers (aiohttp
    # closes it as idle): 75 s let ~1000 half-sent requests (slowloris) hold every file descriptor of a service
    # under systemd's default limit (1024), locking everyone out; now they go after api.read_timeout_s (>= 5 s)
    runner = web.AppRunner(make_app(state), handle_signals=False, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None, auto_decompress=False, keepalive_timeout=header_timeout_s(state.config.api),
                           lingering_time=0.5, max_line_size=8190, max_field_size=8190)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=128)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else port
    return runner, port
