"""`looplm serve`: an OpenAI-compatible HTTP server on the depth-wise serving engine.

One worker thread owns the model, the engine and the scheduler; nothing else touches them. HTTP
handlers (asyncio, FastAPI) only validate, tokenize, hand a Request to the worker through a
thread-safe inbox and await its tokens on an asyncio.Queue that the worker feeds with
``loop.call_soon_threadsafe``. Cancels (a client that went away) travel through the same inbox, so
the scheduler is only ever called from its own thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streamed over SSE or not),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text format).
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}. A request body over
``max_body_bytes`` (``--max-body-bytes``) gets 413 before any of it is parsed (``BodyLimit``).

Parts: api.py (request bodies, errors), worker.py (the thread that owns the engine), metrics.py
(/metrics), this file (requests in, text out, the FastAPI app and `main`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import (
    MAX_BODY_BYTES,
    APIError,
    BodyTooLarge,
    ChatBody,
    CompletionBody,
    body_too_large,
    check_unsupported,
    error_response,
    validation_error,
)
from .engine import Engine
from .exits import ExitPolicy
from .metrics import Metrics
from .request import Request
from .sampling import RequestError, SamplingParams
from .schedulers import warm_up
from .worker import Worker

# --- text out -----------------------------------------------------------------------------------


class TextStream:
    """Incremental detokenization with stop strings: ``add(token)`` returns the new text that is
    safe to send (held back while it ends in an incomplete UTF-8 character or could be the start
    of a stop string); once a stop string appears, ``stopped`` is set and the text is cut before it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False
        self.hold = max((len(s) - 1 for s in self.stop), default=0)

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens: wait for the rest
            return ""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        self.text, self.stopped = (text[: min(hits)], True) if hits else (text, False)
        safe = len(self.text) if self.stopped else max(self.sent, len(self.text) - self.hold)
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta


# --- the app ------------------------------------------------------------------------------------


@dataclass
class ServerOptions:
    model_name: str
    max_concurrency: int = 8
    max_queue: int = 64
    max_seq_len: int = 1024
    exit_policy: ExitPolicy | None = None
    kv_mode: str = "copy"
    scheduler: str = "depth"
    shutdown_timeout: float = 10.0
    compile: bool = False  # torch.compile regions (serve/compiled.py), compiled before the server listens
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body gets 413 (BodyLimit)


class LoopServer:
    def __init__(self, model, tokenizer, opts: ServerOptions):
        self.tok, self.opts = tokenizer, opts
        self.config = model.config
        self.max_seq_len = opts.max_seq_len
        self.engine = Engine(
            model,
            max_batch=opts.max_concurrency,
            max_seq_len=opts.max_seq_len,
            exit_policy=opts.exit_policy,
            kv_mode=opts.kv_mode,
            compile=opts.compile,
        )
        warm_up(self.engine)
        self.metrics = Metrics(model.config.num_loops)
        self.worker = Worker(self.engine, opts.scheduler, self.metrics, opts.max_concurrency + opts.max_queue)
        self.created = int(time.time())
        self.app = self._build_app()

    # request -> prompt ids, sampling, max_tokens
    def _prompt_ids(self, body) -> tuple[list[int], str]:
        if isinstance(body, ChatBody):
            if not getattr(self.tok, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
            msgs = []
            for m in body.messages:
                content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
                msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content})
            try:
                text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template can reject a conversation (e.g. role order)
                raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
            return self.tok(text, add_special_tokens=False)["input_ids"], "messages"
        p = body.prompt
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            return list(p), "prompt"
        if isinstance(p, list):
            if len(p) != 1:
                raise APIError(
                    400,
                    "batched prompts are not supported; send one prompt per request",
                    "prompt",
                    "unsupported_parameter",
                )
            p = p[0]
        return self.tok(p, add_special_tokens=bool(self.config.add_bos_token))["input_ids"], "prompt"

    def _make_request(self, body) -> tuple[Request, list[str]]:
        if body.model != self.opts.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves "
                f"{self.opts.model_name!r} (see /v1/models)",
                "model",
                "model_not_found",
            )
        check_unsupported(body)
        ids, where = self._prompt_ids(body)
        if not ids:
            raise APIError(400, "the prompt is empty; give at least one token", where)
        if len(ids) >= self.max_seq_len:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server's context holds {self.max_seq_len} "
                f"(prompt + max_tokens - 1), so shorten it",
                where,
                "context_length_exceeded",
            )
        room = self.max_seq_len - len(ids) + 1
        max_tokens = body.max_tokens
        if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionBody) else room  # OpenAI's defaults
        if max_tokens > room:
            raise APIError(
                400,
                f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the context "
                f"holds {self.max_seq_len}: at most {room} new tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        req = Request(
            ids,
            max_tokens,
            SamplingParams(body.temperature, body.top_p, body.top_k, body.seed),
            arrival=self.engine.clock(),
            eos_token_id=None if body.ignore_eos else self.tok.eos_token_id,
            full_depth=body.full_depth,
        )
        try:
            self.engine.validate(req)  # read-only; the same checks the scheduler applies
        except RequestError as e:
            msg = str(e)
            raise APIError(
                400,
                msg,
                next(
                    (f for f in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed") if msg.startswith(f)),
                    None,
                ),
            ) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return req, stop

    async def _submit(self, req: Request, tokens: bool) -> asyncio.Queue:
        events: asyncio.Queue = asyncio.Queue()
        if not self.worker.try_submit(req, asyncio.get_running_loop(), events, tokens):
            if not self.worker.accepting:
                raise APIError(503, "the server is shutting down", code="shutting_down", type_="server_error")
            raise APIError(
                429,
                f"the server is at capacity ({self.opts.max_concurrency} running + "
                f"{self.opts.max_queue} queued requests); retry later",
                code="rate_limit_exceeded",
                type_="rate_limit_error",
                headers={"Retry-After": "1"},
            )
        return events

    def _finish_reason(self, req: Request, text: TextStream) -> str:
        if text.stopped or (req.eos_token_id is not None and req.output and req.output[-1] == req.eos_token_id):
            return "stop"
        return "length"

    @staticmethod
    def _failure(req: Request) -> APIError:
        if req.status == "cancelled":
            return APIError(499, "the request was cancelled", code="cancelled")
        return APIError(
            503 if "shutting down" in (req.error or "") else 500,
            f"the request failed: {req.error}",
            type_="server_error",
        )

    def _usage(self, req: Request) -> dict:
        return {
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output),
        }

    async def generate(self, body, http: HTTPRequest):
        req, stop = self._make_request(body)
        events = await self._submit(req, tokens=bool(body.stream or stop))
        text = TextStream(self.tok, stop)
        chat = isinstance(body, ChatBody)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "created": int(time.time()), "model": self.opts.model_name}
        if body.stream:
            return _SSE(self._stream(req, events, text, chat, head, body), on_close=lambda: self._abandon(req))

        async def watch():  # nothing is sent until the end, so poll: a client that gave up frees its slot
            while not await http.is_disconnected():
                await asyncio.sleep(1.0)
            self._abandon(req)

        watcher = asyncio.create_task(watch())
        try:
            while True:
                kind, value = await events.get()
                if kind == "end":
                    break
                if not text.stop:  # nothing to watch for: decode once at the end
                    continue
                if not text.stopped:
                    text.add(value)
                    if text.stopped:
                        self._abandon(req)  # a stop string: no need for more tokens
        finally:
            watcher.cancel()
            self._abandon(req)  # a no-op unless this handler itself was cancelled
        if not text.stop:
            text.text = self.tok.decode(req.output, skip_special_tokens=True)
        if req.status != "done" and not (req.status == "cancelled" and text.stopped):
            raise self._failure(req)
        out, reason = text.text, self._finish_reason(req, text)
        extra = {"looplm": {"exit_loops": req.exit_loops}}
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": out},
                "logprobs": None,
                "finish_reason": reason,
            }
            return {**head, "object": "chat.completion", "choices": [choice], "usage": self._usage(req), **extra}
        choice = {"index": 0, "text": out, "logprobs": None, "finish_reason": reason}
        return {**head, "object": "text_completion", "choices": [choice], "usage": self._usage(req), **extra}

    def _abandon(self, req: Request):
        if not req.finished:
            self.worker.cancel(req)

    async def _stream(self, req, events, text, chat, head, body):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason=None, role=False) -> str:
            if chat:
                d = ({"role": "assistant", "content": ""} if role else {}) | ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            return _sse({**head, "object": obj, "choices": [choice]})

        if chat:
            yield chunk(None, role=True)
        while True:
            kind, value = await events.get()
            if kind == "end":
                break
            if text.stopped:
                continue
            delta = text.add(value)
            if text.stopped:
                self._abandon(req)  # a stop string: no need for more tokens
            if delta:
                yield chunk(delta)
        if req.status != "done" and not (req.status == "cancelled" and text.stopped):
            # an SSE error event: the openai client raises it as an APIError
            yield _sse(self._failure(req).body())
            yield "data: [DONE]\n\n"
            return
        rest = text.flush()
        if rest:
            yield chunk(rest)
        yield chunk(None, reason=self._finish_reason(req, text))
        if (body.stream_options or {}).get("include_usage"):
            yield _sse({**head, "object": obj, "choices": [], "usage": self._usage(req)})
        yield "data: [DONE]\n\n"

    def _build_app(self) -> FastAPI:
        server = self

        @contextlib.asynccontextmanager
        async def lifespan(app):
            server.worker.start()
            yield
            server.worker.stop()  # in-flight requests were given shutdown_timeout by UvicornServer
            m = server.metrics.requests
            print(
                f"looplm serve: stopped ({m['done']} requests done, {m['error']} failed, {m['cancelled']} cancelled)",
                flush=True,
            )

        app = FastAPI(
            title="looplm",
            description="OpenAI-compatible server for looplm models (depth-wise batching)",
            lifespan=lifespan,
        )
        app.add_middleware(BodyLimit, max_bytes=server.opts.max_body_bytes, on_reject=server.metrics.rejected)
        self._add_error_handlers(app)
        self._add_routes(app)
        return app

    def _add_error_handlers(self, app: FastAPI) -> None:
        """Every failure answers in OpenAI's error shape and is counted by its HTTP status."""
        server = self

        @app.exception_handler(APIError)
        async def _api_error(request, exc: APIError):
            server.metrics.rejected(exc.status)
            return error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def _bad_request(request, exc: RequestValidationError):
            server.metrics.rejected(400)
            return error_response(validation_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc: StarletteHTTPException):
            server.metrics.rejected(exc.status_code)
            if isinstance(exc, BodyTooLarge):  # a body without Content-Length that grew past the limit
                return error_response(exc.error)
            code = "not_found" if exc.status_code == 404 else None
            return error_response(APIError(exc.status_code, str(exc.detail), code=code))

        @app.exception_handler(Exception)
        async def _internal(request, exc: Exception):
            server.metrics.rejected(500)
            return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    def _add_routes(self, app: FastAPI) -> None:
        """OpenAI's completions, chat completions and models, beside /health and /metrics."""
        server = self

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: HTTPRequest):
            return await server.generate(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatBody, request: HTTPRequest):
            return await server.generate(body, request)

        def model_card():
            return {
                "id": server.opts.model_name,
                "object": "model",
                "created": server.created,
                "owned_by": "looplm",
                "max_model_len": server.max_seq_len,
                "num_loops": server.config.num_loops,
            }

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != server.opts.model_name:
                raise APIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found")
            return model_card()

        @app.get("/health")
        async def health():
            ok = server.worker.alive and server.worker.accepting
            body = {
                "status": "ok" if ok else "unavailable",
                "worker_alive": server.worker.alive,
                "accepting": server.worker.accepting,
                "model": server.opts.model_name,
            }
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 with an error naming the limit and the fix. A
    declared Content-Length over it is refused before the app runs; a body sent without one (chunked) is counted as
    the app reads it, and the read fails once it passes the limit. Either way the rest of the body is read and
    dropped (never held), so the client receives the answer rather than a reset connection."""

    def __init__(self, app, max_bytes: int, on_reject=None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _drain(receive)
            if self.on_reject:
                self.on_reject(413)
            return await error_response(body_too_large(int(declared), self.max_bytes))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if message.get("more_body", False):
                        seen += await _drain(receive)
                    raise BodyTooLarge(body_too_large(seen, self.max_bytes))
            return message

        await self.app(scope, counted, send)


async def _drain(receive) -> int:
    """Read and drop the rest of a request body; returns its bytes."""
    n = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return n
        n += len(message.get("body", b""))
        if not message.get("more_body", False):
            return n


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _SSE(StreamingResponse):
    """Server-sent events that always run ``on_close`` when the response ends for any reason (a
    client that disconnects cancels the stream; its request must give back its batch slot)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class UvicornServer(uvicorn.Server):
    """uvicorn that starts our graceful drain on SIGINT/SIGTERM: new requests get 503, in-flight
    ones may finish for ``shutdown_timeout`` seconds and are then failed with a clear error (SSE
    streams get an error event), so connections close and uvicorn can exit."""

    def __init__(self, loop_server: LoopServer, **kw):
        grace = loop_server.opts.shutdown_timeout
        super().__init__(uvicorn.Config(loop_server.app, timeout_graceful_shutdown=grace + 5, **kw))
        self.loop_server = loop_server

    def handle_exit(self, sig, frame):
        self.loop_server.worker.drain(self.loop_server.opts.shutdown_timeout)
        super().handle_exit(sig, frame)


def main(args) -> int:
    """`looplm serve MODEL ...` (its settings: ``Serve`` in commands/serve.py)."""
    import torch

    from ..models import load_model
    from ..models.quantized import load_dtype, prepare
    from .exits import parse_policy

    weights = getattr(args, "weights", None)
    converting = bool(args.loops and args.loops > 1)  # conversion reads float32 weights
    model, tok = load_model(args.model, dtype=torch.float32 if converting else load_dtype(weights))
    if converting:
        from .on_the_fly import convert_unhealed

        model = convert_unhealed(
            model, args.model, args.loops, args.init, args.lora_rank, getattr(args, "allow_unhealed", False)
        )
    if args.device:
        model = model.to(args.device)
    model = prepare(model, weights, lora=getattr(args, "lora", None)).eval()
    max_seq_len = min(args.max_seq_len, model.config.max_position_embeddings)
    opts = ServerOptions(
        model_name=args.served_model_name or args.model,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_seq_len=max_seq_len,
        exit_policy=parse_policy(args.exit_policy),
        kv_mode=args.kv_mode,
        scheduler=args.scheduler,
        shutdown_timeout=args.shutdown_timeout,
        compile=getattr(args, "compile", False),
        max_body_bytes=getattr(args, "max_body_bytes", None) or MAX_BODY_BYTES,
    )
    server = LoopServer(model, tok, opts)
    print(
        f"looplm serve: {opts.model_name} (B={model.config.num_loops} loops, exit {server.engine.policy.label}, "
        f"{opts.scheduler} scheduler, {opts.max_concurrency} slots, queue "
        f"{opts.max_queue}, context {max_seq_len}) on http://{args.host}:{args.port}",
        flush=True,
    )
    UvicornServer(server, host=args.host, port=args.port, log_level=args.log_level).run()
    return 0
