"""The OpenAI-compatible HTTP API over one Engine (Starlette under uvicorn): what the `openai` client and tools built
on it call.

    GET  /v1/models              the one model (its id: --model-name, the folder's name by default)
    POST /v1/completions         prompt: text, or token ids; stream (server-sent events) or not
    POST /v1/chat/completions    messages through the folder's chat template; stream or not
    GET  /health                 200 while serving, 503 while shutting down (no API key asked)
    GET  /metrics                Prometheus metrics (serving.metrics; no API key asked)

Beyond OpenAI's fields, `ignore_eos` (as vLLM's server takes it): generate max_tokens even past the end-of-sequence
token (benchmarks). With an API key (--api-key / $AQUA_API_KEY) the /v1 routes ask for `Authorization: Bearer KEY` (401 otherwise), as
OpenAI's do. A request naming another model than this one's gets 404 (model_not_found).

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}): 400 for a request the server cannot run
(refused before any work, a prompt that cannot fit the context included), 429 with Retry-After when the queue is
full, 503 while shutting down. A client that disconnects cancels its sequence (its row freed at the next step).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from ..config import ConfigError
from ..runtime.sampling import SamplingConfig
from .engine import Busy, Engine, Sequence
from .metrics import Metrics


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, default, lo=None, hi=None, kind=float):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise RequestError(f"{name} must be a{'n integer' if kind is int else ' number'}, got {v!r}", name)
    v = kind(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        where = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else \
            f"<= {hi}"
        raise RequestError(f"{name} must be {where}, got {v}", name)
    return v


# the chat roles a folder's template is given (OpenAI's "developer" is its newer name for "system"); tools and
# function calls are not served, so their roles are refused rather than passed to a template that cannot read them
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _messages(body: dict) -> list[dict]:
    """OpenAI's chat messages -> [{role, content: str}] for the chat template: content as text or as a list of text
    parts ({"type": "text", "text"}, joined with newlines, as vLLM's server joins them); anything else is one 400
    naming the message."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise RequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r} (tools and "
                               "function calls are not served)", "messages")
        content = m.get("content")
        if isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            if not content or kinds != ["text"] * len(content) or not all(isinstance(p.get("text"), str)
                                                                          for p in content):
                other = next((k for k in kinds if k != "text"), "text without a string")
                raise RequestError(f"messages[{i}].content must be text or a list of text parts ({{\"type\": "
                                   f"\"text\", \"text\": ...}}); got a {other!r} part: this model reads text only",
                                   "messages")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be text or a list of text parts", "messages")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out


def chat_ids(tok, msgs: list[dict]) -> list[int]:
    """[{role, content}] through the folder's chat template, with the assistant's turn opened -> prompt ids."""
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def least_context(tok) -> int:
    """The shortest context a request fits in: the chat template around one empty message and a token to generate
    (a folder without a template: a one-token prompt and one generated)."""
    return len(chat_ids(tok, [{"role": "user", "content": ""}])) + 1 if tok.chat_template else 2


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings", "stop")
    return stops


class Api:
    """The routes over an Engine (whose thread the app's lifespan starts and stops), the folder's tokenizer and the
    model's name."""

    def __init__(self, engine: Engine, tok, name: str, api_key: str = ""):
        self.engine, self.tok, self.name, self.api_key = engine, tok, name, api_key
        self.eos = frozenset(i for i in (tok.eos_token_id,) if i is not None)
        self.closing = False
        self.metrics = Metrics()

    def _authorize(self, request) -> None:
        import hmac

        if self.api_key and not hmac.compare_digest(request.headers.get("authorization", ""),
                                                    f"Bearer {self.api_key}"):
            raise RequestError("Incorrect API key provided: send `Authorization: Bearer KEY` with the server's key",
                               code="invalid_api_key", status=401)

    # ------------------------------------------------------------------ request -> sequence
    def _sampling(self, body: dict, prompt: int, default_max: int) -> SamplingConfig:
        for name in ("n", "best_of"):
            if body.get(name, 1) != 1:
                raise RequestError(f"{name} must be 1 (one completion per request)", name)
        for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"):
            if body.get(name) not in (None, False, [], {}):
                raise RequestError(f"{name} is not supported by this server", name)
        for name in ("presence_penalty", "frequency_penalty"):  # asked but not applied would change no token silently
            if body.get(name) not in (None, 0):
                raise RequestError(f"{name} is not applied by this server: send 0 or leave it out", name)
        if body.get("response_format") not in (None, {"type": "text"}):
            raise RequestError("response_format: this server answers in text only ({\"type\": \"text\"})",
                               "response_format")
        if body.get("tool_choice") not in (None, "none"):
            raise RequestError("tool_choice: tools are not served (\"none\" or leave it out)", "tool_choice")
        room = self.engine.context - prompt
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        new = default_max if limit is None else _number({"max_tokens": limit}, "max_tokens", 0, 1, None, int)
        if room < 1 or new > room:
            raise RequestError(f"this model's context is {self.engine.context} tokens; the prompt has {prompt} and "
                               f"{new} were asked to be generated: shorten the prompt or ask for fewer tokens",
                               "messages" if "messages" in body else "prompt", "context_length_exceeded")
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        return SamplingConfig(max_new_tokens=min(new, room), do_sample=temperature > 0,
                              temperature=temperature or 1.0, top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
                              seed=_number(body, "seed", -1, None, None, int))

    def prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            msgs = _messages(body)
            if not self.tok.chat_template:
                raise RequestError("this folder's tokenizer has no chat template: use /v1/completions", "messages")
            return chat_ids(self.tok, msgs)
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str) and p:
            return list(self.tok(p)["input_ids"])
        vocab = self.engine.lm.contract.vocab
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                             for t in p):
            return p
        raise RequestError(f"prompt must be non-empty text or a list of token ids in [0, {vocab}) (one prompt per "
                           "request)", "prompt")

    # ------------------------------------------------------------------ the routes
    async def models(self, request):
        from starlette.responses import JSONResponse

        try:
            self._authorize(request)
        except RequestError as e:
            return self._refuse(e)
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": 0,
                                                         "owned_by": "aqua-export"}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        if self.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        e = self.engine
        return JSONResponse({"status": "ok", "running": len(e.live), "waiting": len(e.waiting), "finished": e.finished,
                             "cancelled": e.cancelled, "generated": e.generated, "prefix_hits": e.prefix.hits})

    async def metrics_text(self, request):
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(self.metrics.render(self.engine), media_type="text/plain; version=0.0.4")

    def _refuse(self, e: RequestError):
        from starlette.responses import JSONResponse

        self.metrics.reject({429: "queue_full", 503: "closing"}.get(e.status, "invalid"))
        headers = {"Retry-After": "1"} if e.status == 429 else None
        kind = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                429: "rate_limit_exceeded"}.get(e.status, "server_error")
        return JSONResponse(error_body(str(e), kind, e.param, e.code), status_code=e.status, headers=headers)

    async def completions(self, request):
        return await self._serve(request, chat=False)

    async def chat(self, request):
        return await self._serve(request, chat=True)

    async def _serve(self, request, chat: bool):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            if self.closing:
                raise RequestError("the server is shutting down", status=503)
            self._authorize(request)
            try:
                body = json.loads(await request.body())
            except ValueError:  # UnicodeDecodeError included: a body that is not UTF-8
                raise RequestError("the request body is not JSON (UTF-8)") from None
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            if body.get("model") != self.name:
                raise RequestError(f"The model `{body.get('model')}` does not exist: this server serves "
                                   f"`{self.name}` (GET /v1/models)", "model", "model_not_found", 404)
            if not isinstance(body.get("stream", False), bool):
                raise RequestError("stream must be true or false", "stream")
            ids = self.prompt_ids(body, chat)
            sampling = self._sampling(body, len(ids), self.engine.context - len(ids) if chat else 16)
            stops = _stops(body)
            if not isinstance(body.get("ignore_eos", False), bool):
                raise RequestError("ignore_eos must be true or false", "ignore_eos")
            options = body.get("stream_options") or {}
            if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
                raise RequestError("stream_options must be an object, its include_usage true or false",
                                   "stream_options")
            run = Run(self, ids, sampling, stops, chat, body.get("ignore_eos", False),
                      options.get("include_usage", False))
            run.submit()
        except RequestError as e:
            return self._refuse(e)
        if body.get("stream"):
            return StreamingResponse(run.events(request), media_type="text/event-stream")
        try:
            return JSONResponse(await run.whole(request))
        except RequestError as e:
            return JSONResponse(error_body(str(e), "server_error"), status_code=e.status)

    def app(self):
        """The Starlette app; its lifespan runs the engine's thread and, at shutdown (uvicorn's SIGTERM: no new
        connections, in-flight requests finish), stops it once the sequences in flight are done."""
        import contextlib
        import threading

        from starlette.applications import Starlette
        from starlette.routing import Route

        @contextlib.asynccontextmanager
        async def lifespan(app):
            thread = threading.Thread(target=self.engine.run, name="aqua-engine", daemon=True)
            thread.start()
            try:
                yield
            finally:
                self.closing = True
                self.engine.stop()
                await asyncio.to_thread(thread.join)

        return Starlette(routes=[Route("/v1/models", self.models), Route("/health", self.health),
                                 Route("/metrics", self.metrics_text),
                                 Route("/v1/completions", self.completions, methods=["POST"]),
                                 Route("/v1/chat/completions", self.chat, methods=["POST"])], lifespan=lifespan)


class Run:
    """One request in flight: its sequence in the engine, the events it sends back (a queue on the server's event
    loop), and its text so far, cut at a stop string."""

    def __init__(self, api: Api, ids: list[int], sampling: SamplingConfig, stops: list[str], chat: bool,
                 ignore_eos: bool = False, usage_chunk: bool = False):
        self.api, self.ids, self.stops, self.chat = api, ids, stops, chat
        self.usage_chunk = usage_chunk  # stream_options.include_usage: a last chunk of no choices carries the usage
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seq = Sequence(ids, sampling, self._from_engine, frozenset() if ignore_eos else api.eos)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.text = ""  # decoded so far (stop strings cut)
        self.sent = 0  # characters of text already streamed
        self.finish: str | None = None
        self.stopped = False  # a stop string was found: the text is final

    def _from_engine(self, token, finish) -> None:  # the engine's thread
        m, times = self.api.metrics, self.seq.times
        if finish is not None:
            m.done(finish, len(self.ids))
        elif len(self.seq.out) == 1:
            m.first_token(times["first_token"] - times["submitted"])
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, finish))

    def submit(self) -> None:
        try:
            self.api.engine.submit(self.seq)
        except Busy as e:
            raise RequestError(f"the server is busy ({e}): retry later", status=429) from None
        except ConfigError as e:
            raise RequestError(str(e), "prompt", "context_length_exceeded") from None

    async def _next(self, request) -> bool:
        """Wait for the engine's next event; False once finished. A disconnected client cancels the sequence."""
        while True:
            try:
                token, finish = await asyncio.wait_for(self.queue.get(), 0.5)
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.api.engine.cancel(self.seq)
                    raise asyncio.CancelledError from None
        if finish is not None:  # a stop string found here ends it as "stop" even when the engine ran to its limit
            self.finish = "stop" if self.stopped or finish in ("stop", "cancelled") else finish  # before the cancel
            self._decode(final=True)
            return False
        if not self.stopped:  # tokens the engine made before the cancel reached it are not the answer's
            self.tokens.append(token)
            self._decode(final=False)
        return True

    def _decode(self, final: bool) -> None:
        if self.stopped:
            return
        text = self.api.tok.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            self.api.engine.cancel(self.seq)  # reported back as finished ("stop")
        elif final or not text.endswith("\ufffd"):
            self.text = text

    def _ready(self) -> str:
        """New text that can be sent: held back while it could still become a stop string."""
        hold = 0 if self.finish else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self.sent, len(self.text) - hold)
        new, self.sent = self.text[self.sent:end], end
        return new

    def _usage(self) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.ids) + len(self.tokens)}

    async def whole(self, request) -> dict:
        try:
            while await self._next(request):
                pass
        except asyncio.CancelledError:
            self.api.engine.cancel(self.seq)
            raise
        if self.finish.startswith("error"):
            raise RequestError(f"the model failed ({self.finish}): see the server's log", status=500)
        choice = {"index": 0, "finish_reason": self.finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice.update(text=self.text, logprobs=None)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.api.name, "choices": [choice], "usage": self._usage()}

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps(self._event([choice], self._usage() if finish is not None else None))}\n\n"

    def _event(self, choices: list, usage: dict | None) -> dict:
        """One streamed chunk's body (usage only when given)."""
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.api.name, "choices": choices}
        return body | ({"usage": usage} if usage is not None else {})

    async def events(self, request):
        """Server-sent events: a chunk per piece of text, the last with finish_reason and usage, then [DONE]. The
        client going away (the response task cancelled, or noticed while waiting) cancels the sequence."""
        try:
            if self.chat:
                yield self._chunk(None, None, first=True)
            while await self._next(request):
                new = self._ready()
                if new:
                    yield self._chunk(new, None)
            new = self._ready()
            if new:
                yield self._chunk(new, None)
            yield self._chunk(None, self.finish)
            if self.usage_chunk:
                yield f"data: {json.dumps(self._event([], self._usage()))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not self.seq.done:
                self.api.engine.cancel(self.seq)
