"""`looplm serve`: an OpenAI-compatible HTTP server on the depth-wise serving engine.

One worker thread owns the model, the engine and the scheduler; nothing else touches them. HTTP
handlers (asyncio, FastAPI) only validate, tokenize, hand a Request to the worker through a
thread-safe inbox and await its tokens on an asyncio.Queue that the worker feeds with
``loop.call_soon_threadsafe``. Cancels (a client that went away) travel through the same inbox, so
the scheduler is only ever called from its own thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streamed over SSE or not),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text format).
Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import Engine, Request
from .exits import ExitPolicy
from .sampling import RequestError, SamplingParams
from .schedulers import make_scheduler


# --- errors in OpenAI's shape ----------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# Union-typed fields give one pydantic error per alternative; say what is accepted instead.
_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list with one string, or a list of token ids",
    "stop": "stop must be a string or a list of up to 4 strings",
    "content": "message content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({err.get('msg')})", code="invalid_json")
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {err.get('msg')}")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter {loc[-1]!r}", param=loc[-1], code="unsupported_parameter")
    # the first name in loc that is a field (not a union alternative like 'list[int]' or an index)
    field = next((x for x in reversed(loc) if x in _UNION_MESSAGES), None)
    if field:
        return APIError(400, _UNION_MESSAGES[field], param=field)
    param = loc[0] if len(loc) == 1 else ".".join(loc)
    return APIError(400, f"{param}: {err.get('msg')}", param=loc[0])


# --- request bodies ------------------------------------------------------------------------------

class _Body(BaseModel):
    # strict: "5" is not a number and 1.0 is not a whole number; extra="forbid": a misspelt or
    # unsupported parameter is an error rather than silently ignored
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # looplm extras (extra_body in the openai client)
    top_k: int = Field(0, ge=0, le=2 ** 31)
    full_depth: bool = False  # run every loop for every token: no early exit for this request
    ignore_eos: bool = False  # keep going to max_tokens (load tests)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None


def _check_unsupported(body: _Body) -> None:
    """Parameters we accept only at their no-op value (clients often send the defaults)."""
    checks = [("n", body.n == 1, "n > 1 is not supported; send one request per completion"),
              ("presence_penalty", body.presence_penalty == 0, "presence_penalty is not supported (use 0)"),
              ("frequency_penalty", body.frequency_penalty == 0, "frequency_penalty is not supported (use 0)"),
              ("logit_bias", not body.logit_bias, "logit_bias is not supported")]
    if isinstance(body, CompletionBody):
        checks += [("echo", not body.echo, "echo is not supported"),
                   ("logprobs", body.logprobs is None, "logprobs are not supported"),
                   ("best_of", body.best_of in (None, 1), "best_of > 1 is not supported"),
                   ("suffix", body.suffix is None, "suffix is not supported")]
    else:
        checks += [("logprobs", not body.logprobs, "logprobs are not supported"),
                   ("top_logprobs", body.top_logprobs is None, "top_logprobs are not supported")]
    for param, ok, msg in checks:
        if not ok:
            raise APIError(400, msg, param=param, code="unsupported_parameter")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise APIError(400, "stop takes at most 4 strings", param="stop")
    if body.stream_options is not None:
        if not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        extra = set(body.stream_options) - {"include_usage"}
        if extra or not isinstance(body.stream_options.get("include_usage", False), bool):
            raise APIError(400, "stream_options takes only include_usage (a boolean)", param="stream_options")


# --- metrics ------------------------------------------------------------------------------------

class Metrics:
    """Counters and gauges, written by the worker and the handlers, read by /metrics (one lock)."""

    def __init__(self, num_loops: int, window: float = 10.0):
        self.lock = threading.Lock()
        self.num_loops, self.window = num_loops, window
        self.requests = {"done": 0, "error": 0, "cancelled": 0}  # finished in the engine, by status
        self.http_errors: dict[int, int] = {}                     # rejected before the engine, by status
        self.tokens_total = 0
        self.steps_total = 0
        self.step_seconds = 0.0
        self.worker_faults = 0
        self.queue_depth = 0
        self.running = 0
        self.occupancy = [0] * num_loops  # items at each loop in the last step
        self.exits = [0] * num_loops      # tokens emitted after each loop (from the engine)
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step, for tokens/s

    def observe_step(self, items) -> None:
        counts = [0] * self.num_loops
        for it in items:
            if it.req.status == "running":
                counts[it.loop] += 1
        with self.lock:
            self.occupancy = counts

    def after_step(self, tokens: int, seconds: float, exits) -> None:
        now = time.monotonic()
        with self.lock:
            self.steps_total += 1
            self.step_seconds += seconds
            self.tokens_total += tokens
            self.exits = list(exits)
            if tokens:
                self.recent.append((now, tokens))
            while self.recent and self.recent[0][0] < now - self.window:
                self.recent.popleft()

    def set_load(self, queued: int, running: int) -> None:
        with self.lock:
            self.queue_depth, self.running = queued, running
            if not running:
                self.occupancy = [0] * self.num_loops

    def finished(self, status: str) -> None:
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1

    def rejected(self, status: int) -> None:
        with self.lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self) -> str:
        with self.lock:
            now = time.monotonic()
            recent = sum(n for t, n in self.recent if t >= now - self.window)
            lines = []

            def metric(name, kind, help_, samples):
                lines.extend([f"# HELP looplm_{name} {help_}", f"# TYPE looplm_{name} {kind}"])
                for labels, value in samples:
                    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                    lines.append(f"looplm_{name}{{{lab}}} {value}" if lab else f"looplm_{name} {value}")

            metric("queue_depth", "gauge", "Requests waiting for a batch slot.", [({}, self.queue_depth)])
            metric("running_requests", "gauge", "Requests holding a batch slot (KV cache row).", [({}, self.running)])
            metric("batch_occupancy", "gauge", "Work items at each loop (depth) in the last engine step.",
                   [({"loop": str(i + 1)}, n) for i, n in enumerate(self.occupancy)])
            metric("exits_total", "counter", "Tokens emitted after each loop (early exits are loops < the last).",
                   [({"loop": str(i + 1)}, n) for i, n in enumerate(self.exits)])
            metric("generated_tokens_total", "counter", "Tokens generated.", [({}, self.tokens_total)])
            metric("tokens_per_second", "gauge", f"Tokens generated per second over the last {self.window:g} s.",
                   [({}, round(recent / self.window, 3))])
            metric("engine_steps_total", "counter", "Engine steps (one loop over a batch).", [({}, self.steps_total)])
            metric("engine_step_seconds_total", "counter", "Seconds spent in engine steps.",
                   [({}, round(self.step_seconds, 6))])
            metric("requests_total", "counter", "Requests finished in the engine, by status.",
                   [({"status": s}, n) for s, n in sorted(self.requests.items())])
            metric("http_errors_total", "counter", "Requests rejected before the engine, by HTTP status.",
                   [({"status": str(s)}, n) for s, n in sorted(self.http_errors.items())])
            metric("errors_total", "counter", "Failed requests: engine errors plus HTTP rejections.",
                   [({}, self.requests.get("error", 0) + sum(self.http_errors.values()))])
            metric("worker_faults_total", "counter", "Unexpected exceptions in the worker loop.",
                   [({}, self.worker_faults)])
        return "\n".join(lines) + "\n"


# --- the worker thread --------------------------------------------------------------------------

class Worker:
    """Owns the engine and scheduler. Handlers call try_submit/cancel (thread-safe) and read
    ("token", id) events (if they asked for tokens) and one ("end", None) from their asyncio.Queue.
    Events are handed to each event loop once per step in one batch: waking the loop once per
    token would make it fight the worker for the GIL."""

    def __init__(self, engine: Engine, scheduler: str, metrics: Metrics, capacity: int):
        self.engine, self.metrics, self.capacity = engine, metrics, capacity
        self.scheduler = make_scheduler(scheduler, engine)
        self.inbox: queue.Queue = queue.Queue()
        self.active: dict[Request, tuple] = {}  # request -> (event loop, asyncio.Queue)
        self.outbox: list[tuple[Request, tuple]] = []  # events to deliver after this step
        self.lock = threading.Lock()
        self.inflight = 0            # submitted and not yet finished (the backpressure count)
        self.accepting = True
        self.deadline: float | None = None  # shutdown: fail whatever is still running after this
        self.stopped = False
        inner = engine.step

        def counted_step(items):  # batch occupancy by loop, seen at the engine's own entry point
            metrics.observe_step(items)
            return inner(items)
        engine.step = counted_step
        self.thread = threading.Thread(target=self._run, name="looplm-worker", daemon=True)

    def start(self):
        self.thread.start()

    def try_submit(self, req: Request, loop, events, tokens: bool) -> bool:
        """Queue a request unless the server is full or shutting down (then False, nothing queued).
        With ``tokens``, every generated token is sent as an event (streaming, stop strings)."""
        if tokens:
            req.on_token = lambda r, tok: self.outbox.append((r, ("token", tok)))
        with self.lock:  # queued under the lock: a drain/stop cannot slip between the check and the put
            if not self.accepting or self.inflight >= self.capacity:
                return False
            self.inflight += 1
            self.inbox.put(("submit", req, (loop, events)))
        return True

    def cancel(self, req: Request) -> None:
        self.inbox.put(("cancel", req, None))

    def drain(self, grace: float) -> None:
        """Stop taking requests; let in-flight ones finish for ``grace`` seconds, then fail them."""
        with self.lock:
            self.accepting = False
        self.deadline = time.monotonic() + grace
        self.inbox.put(("wake", None, None))

    def stop(self, timeout: float = 10.0) -> None:
        self.drain(0.0)
        self.stopped = True
        self.inbox.put(("wake", None, None))
        self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self):
        while not (self.stopped and not self.active):
            try:
                self._iteration()
            except Exception as e:  # a bug outside the engine's per-batch guard: fail the running requests
                with self.metrics.lock:  # (we cannot tell which one caused it) and keep serving the others
                    self.metrics.worker_faults += 1
                self._fail_all(f"engine fault: {type(e).__name__}: {e}", running_only=True)
                self._notify_finished()

    def _iteration(self):
        self._take_inbox(block=not self.scheduler.has_work())
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self._fail_all("the server is shutting down; the request was not finished")
        if self.scheduler.has_work():
            stats = self.engine.stats
            t0, before = time.perf_counter(), sum(stats["exits_per_loop"])
            try:
                self.scheduler.step()
            finally:
                stats["stage_times"].clear()  # the engine keeps per-step timings; a server runs for ever
                self.metrics.after_step(sum(stats["exits_per_loop"]) - before, time.perf_counter() - t0,
                                        stats["exits_per_loop"])
        self._notify_finished()
        self.metrics.set_load(sum(r.status == "queued" for r in self.scheduler.waiting),
                              self.engine.cache.num_rows - self.engine.cache.free_rows)

    def _take_inbox(self, block: bool):
        try:
            msg = self.inbox.get(timeout=0.1) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, req, reply_to = msg
            if kind == "submit":
                self.active[req] = reply_to
                self.scheduler.submit(req)  # an invalid request fails at once; _notify_finished reports it
            elif kind == "cancel" and req in self.active and not req.finished:
                self.scheduler.cancel(req)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, message: str, running_only: bool = False):
        for req in list(self.active):
            if not req.finished and (req.status == "running" or not running_only):
                self.engine.finish(req, "error", message)
        self.scheduler.waiting = deque(r for r in self.scheduler.waiting if not r.finished)

    def _notify_finished(self):
        ended = [r for r in self.active if r.finished]
        self.outbox += [(r, ("end", None)) for r in ended]
        by_loop: dict = {}
        for req, event in self.outbox:
            loop, events = self.active[req]
            by_loop.setdefault(loop, []).append((events, event))
        self.outbox = []
        for req in ended:
            del self.active[req]
            with self.lock:
                self.inflight -= 1
            self.metrics.finished(req.status)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that event loop is closed (shutdown); nobody is left to tell
                pass


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
        self.text, self.stopped = (text[:min(hits)], True) if hits else (text, False)
        safe = len(self.text) if self.stopped else max(self.sent, len(self.text) - self.hold)
        return self._take(safe)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent:upto]
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


class LoopServer:
    def __init__(self, model, tokenizer, opts: ServerOptions):
        self.tok, self.opts = tokenizer, opts
        self.config = model.config
        self.max_seq_len = opts.max_seq_len
        self.engine = Engine(model, max_batch=opts.max_concurrency, max_seq_len=opts.max_seq_len,
                             exit_policy=opts.exit_policy, kv_mode=opts.kv_mode)
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
                raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt",
                               "unsupported_parameter")
            p = p[0]
        return self.tok(p, add_special_tokens=bool(self.config.add_bos_token))["input_ids"], "prompt"

    def _make_request(self, body) -> tuple[Request, list[str]]:
        if body.model != self.opts.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.opts.model_name!r} (see /v1/models)", "model", "model_not_found")
        _check_unsupported(body)
        ids, where = self._prompt_ids(body)
        if not ids:
            raise APIError(400, "the prompt is empty; give at least one token", where)
        if len(ids) >= self.max_seq_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context holds {self.max_seq_len} "
                                f"(prompt + max_tokens - 1), so shorten it", where, "context_length_exceeded")
        room = self.max_seq_len - len(ids) + 1
        max_tokens = body.max_tokens
        if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionBody) else room  # OpenAI's defaults
        if max_tokens > room:
            raise APIError(400, f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the context "
                                f"holds {self.max_seq_len}: at most {room} new tokens", "max_tokens",
                           "context_length_exceeded")
        req = Request(ids, max_tokens, SamplingParams(body.temperature, body.top_p, body.top_k, body.seed),
                      arrival=self.engine.clock(), eos_token_id=None if body.ignore_eos else self.tok.eos_token_id,
                      full_depth=body.full_depth)
        try:
            self.engine.validate(req)  # read-only; the same checks the scheduler applies
        except RequestError as e:
            msg = str(e)
            raise APIError(400, msg, next((f for f in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed")
                                           if msg.startswith(f)), None)) from None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return req, stop

    async def _submit(self, req: Request, tokens: bool) -> asyncio.Queue:
        events: asyncio.Queue = asyncio.Queue()
        if not self.worker.try_submit(req, asyncio.get_running_loop(), events, tokens):
            if not self.worker.accepting:
                raise APIError(503, "the server is shutting down", code="shutting_down", type_="server_error")
            raise APIError(429, f"the server is at capacity ({self.opts.max_concurrency} running + "
                                f"{self.opts.max_queue} queued requests); retry later", code="rate_limit_exceeded",
                           type_="rate_limit_error", headers={"Retry-After": "1"})
        return events

    def _finish_reason(self, req: Request, text: TextStream) -> str:
        if text.stopped or (req.eos_token_id is not None and req.output and req.output[-1] == req.eos_token_id):
            return "stop"
        return "length"

    @staticmethod
    def _failure(req: Request) -> APIError:
        if req.status == "cancelled":
            return APIError(499, "the request was cancelled", code="cancelled")
        return APIError(503 if "shutting down" in (req.error or "") else 500,
                        f"the request failed: {req.error}", type_="server_error")

    def _usage(self, req: Request) -> dict:
        return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                "total_tokens": len(req.prompt) + len(req.output)}

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
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                      "finish_reason": reason}
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
            print(f"looplm serve: stopped ({m['done']} requests done, {m['error']} failed, {m['cancelled']} cancelled)",
                  flush=True)

        app = FastAPI(title="looplm", description="OpenAI-compatible server for looplm models (depth-wise batching)",
                      lifespan=lifespan)

        @app.exception_handler(APIError)
        async def _api_error(request, exc: APIError):
            server.metrics.rejected(exc.status)
            return _error_response(exc)

        @app.exception_handler(RequestValidationError)
        async def _bad_request(request, exc: RequestValidationError):
            server.metrics.rejected(400)
            return _error_response(_validation_error(exc))

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request, exc: StarletteHTTPException):
            server.metrics.rejected(exc.status_code)
            code = "not_found" if exc.status_code == 404 else None
            return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

        @app.exception_handler(Exception)
        async def _internal(request, exc: Exception):
            server.metrics.rejected(500)
            return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: HTTPRequest):
            return await server.generate(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatBody, request: HTTPRequest):
            return await server.generate(body, request)

        def model_card():
            return {"id": server.opts.model_name, "object": "model", "created": server.created, "owned_by": "looplm",
                    "max_model_len": server.max_seq_len, "num_loops": server.config.num_loops}

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
            body = {"status": "ok" if ok else "unavailable", "worker_alive": server.worker.alive,
                    "accepting": server.worker.accepting, "model": server.opts.model_name}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

        return app


def _deliver(batch):
    for events, event in batch:
        events.put_nowait(event)


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
    """`looplm serve MODEL ...` (arguments defined in serve/cli.py)."""
    import torch
    from ..models import load_model
    from .exits import parse_policy
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    if args.loops and args.loops > 1:
        from ..convert import convert, parse_lora_ranks
        model = convert(model, loops=args.loops, init=args.init, lora_ranks=parse_lora_ranks(None, args.lora_rank),
                        norms="per-depth", seed=0)
    if args.device:
        model = model.to(args.device)
    model.eval()
    max_seq_len = min(args.max_seq_len, model.config.max_position_embeddings)
    opts = ServerOptions(model_name=args.served_model_name or args.model, max_concurrency=args.max_concurrency,
                         max_queue=args.max_queue, max_seq_len=max_seq_len, exit_policy=parse_policy(args.exit_policy),
                         kv_mode=args.kv_mode, scheduler=args.scheduler, shutdown_timeout=args.shutdown_timeout)
    server = LoopServer(model, tok, opts)
    print(f"looplm serve: {opts.model_name} (B={model.config.num_loops} loops, exit {server.engine.policy.kind}:"
          f"{server.engine.policy.threshold}, {opts.scheduler} scheduler, {opts.max_concurrency} slots, queue "
          f"{opts.max_queue}, context {max_seq_len}) on http://{args.host}:{args.port}", flush=True)
    UvicornServer(server, host=args.host, port=args.port, log_level=args.log_level).run()
    return 0
