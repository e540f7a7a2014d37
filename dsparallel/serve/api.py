"""The OpenAI-compatible HTTP face of an ``Engine`` (FastAPI, on rank 0):
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``.

Requests are checked here and answered with OpenAI's error object and a
4xx status: malformed JSON, a wrong field, an unknown model (404), a prompt
the context cannot hold (400), a full queue (429). A streamed request
whose client goes away is aborted, which frees its blocks at the engine's
next step. Fields beyond OpenAI's, as vLLM has them: ``top_k``,
``ignore_eos``, ``return_token_ids`` (each choice's generated ids).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .engine import Event, QueueFull, SamplingParams


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _error(message: str, status: int, param: str | None = None):
    kind = {404: "not_found_error", 429: "rate_limit_error"}.get(status, "invalid_request_error")
    if status >= 500:
        kind = "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _number(body: dict, name: str, default, kind=float, low=None, high=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(
            f"'{name}' must be {'a number' if kind is float else 'an integer'}", param=name
        )
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{name}' must be in [{low}, {high}], got {value}", param=name)
    return kind(value)


class Server:
    """The app's state: the engine, the tokenizer, the served name and the
    checkpoint's generation defaults."""

    def __init__(self, engine, tokenizer, model_name: str, defaults: dict):
        self.engine, self.tokenizer = engine, tokenizer
        self.name, self.defaults = model_name, defaults

    # --------------------------------------------------------------- inputs

    def params(self, body: dict, prompt_len: int, max_name: str = "max_tokens") -> SamplingParams:
        room = self.engine.max_model_len - prompt_len
        if room <= 0:
            raise BadRequest(
                f"the prompt is {prompt_len} tokens, the model's context is "
                f"{self.engine.max_model_len}",
                param="prompt" if max_name == "max_tokens" else "messages",
            )
        name = max_name if body.get(max_name) is not None else "max_tokens"
        max_tokens = _number(body, name, room, int, 1)
        if max_tokens > room:
            raise BadRequest(
                f"the prompt ({prompt_len} tokens) plus {name} ({max_tokens}) is more than "
                f"the model's context of {self.engine.max_model_len} tokens",
                param=name,
            )
        d = self.defaults
        greedy_default = d.get("do_sample") is False
        temperature = _number(
            body, "temperature", 0.0 if greedy_default else d.get("temperature", 1.0), float, 0, 2
        )
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > 4
        ):
            raise BadRequest(
                "'stop' must be a string or a list of at most 4 non-empty strings", param="stop"
            )
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("'seed' must be an integer", param="seed")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=_number(body, "top_p", float(d.get("top_p", 1.0)), float, 0, 1),
            top_k=_number(body, "top_k", int(d.get("top_k", 0) or 0), int, -1),
            seed=seed,
            stop=tuple(stop),
            ignore_eos=bool(body.get("ignore_eos")),
        )

    def completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [self._encode(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return [list(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [self._encode(p) for p in prompt]
            if all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt
            ):
                return [list(p) for p in prompt]
        raise BadRequest(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "such lists (none empty)",
            param="prompt",
        )

    def chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise BadRequest(
                "'messages' must be a non-empty list of {role, content} objects with string "
                "content",
                param="messages",
            )
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template", param="messages")
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequest(
                "this model has no tokenizer: give the prompt as token ids", param="prompt"
            )
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    # ------------------------------------------------------------ the work

    def launch(self, prompts: list[list[int]], body: dict, max_name: str):
        """Submits n sequences per prompt; returns [(queue, seq)], choice order."""
        n = _number(body, "n", 1, int, 1, 16)
        loop = asyncio.get_running_loop()
        launched = []
        try:
            for prompt in prompts:
                base = self.params(body, len(prompt), max_name)
                for i in range(n):
                    seed = None if base.seed is None else base.seed + i
                    params = dataclasses.replace(base, seed=seed)
                    queue: asyncio.Queue = asyncio.Queue()

                    def sink(event, queue=queue):
                        try:
                            loop.call_soon_threadsafe(queue.put_nowait, event)
                        except RuntimeError:  # the server is shutting down
                            pass

                    seq = self.engine.submit(prompt, params, sink)
                    launched.append((queue, seq))
        except BaseException:
            for _, seq in launched:
                self.engine.abort(seq)
            raise
        return launched


def make_app(server: Server):
    app = FastAPI(title="dsparallel", docs_url=None, redoc_url=None)

    async def read(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != server.name:
            raise BadRequest(
                f"the model '{model}' does not exist; this server serves '{server.name}'",
                404,
                "model",
            )
        return body

    @app.exception_handler(BadRequest)
    async def bad_request(request, e: BadRequest):
        return _error(str(e), e.status, e.param)

    @app.exception_handler(QueueFull)
    async def queue_full(request, e: QueueFull):
        return _error(f"the server is busy: {e}; retry later", 429)

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return _error(f"the engine stopped: {server.engine.error}", 503)
        engine = server.engine
        return {
            "status": "ok",
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "kv_blocks": engine.pool.num_blocks,
            "kv_blocks_free": engine.pool.num_free,
            "steps": engine.steps,
            "preemptions": engine.preemptions,
            "tensor_parallel": engine.model.layout.tp_size,
            "pipeline_parallel": engine.model.layout.pp_size,
        }

    @app.get("/v1/models")
    async def models():
        card = {
            "id": server.name,
            "object": "model",
            "created": 0,
            "owned_by": "dsparallel",
            "max_model_len": server.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def respond(request: Request, chat: bool):
        body = await read(request)
        if chat:
            prompts, max_name = [server.chat_prompt(body)], "max_completion_tokens"
        else:
            prompts, max_name = server.completion_prompts(body), "max_tokens"
        stream = bool(body.get("stream"))
        prompt_tokens = sum(len(p) for p in prompts)
        try:
            launched = server.launch(prompts, body, max_name)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        want_ids = bool(body.get("return_token_ids"))
        if stream:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = _stream(
                server,
                launched,
                ident,
                created,
                kind,
                chat,
                want_ids,
                usage,
                request,
                prompt_tokens,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        return await _whole(
            server, launched, ident, created, kind, chat, want_ids, request, prompt_tokens
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    return app


async def _next(queue: asyncio.Queue, request) -> Event | None:
    """The next event, or None once the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _failed(reason: str | None) -> bool:
    return reason is not None and reason.startswith("error")


async def _whole(server, launched, ident, created, kind, chat, want_ids, request, prompt_tokens):
    choices, completion_tokens = [], 0
    try:
        for index, (queue, _) in enumerate(launched):
            text, ids = [], []
            while True:
                event = await _next(queue, request)
                if event is None:
                    return _error("the client disconnected", 499)
                text.append(event.text)
                ids += event.token_ids
                if event.finish_reason:
                    break
            if _failed(event.finish_reason):
                return _error(event.finish_reason, 500)
            completion_tokens += event.completion_tokens
            choice = {"index": index, "finish_reason": event.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(text)}
            else:
                choice["text"] = "".join(text)
            if want_ids:
                choice["token_ids"] = ids
            choices.append(choice)
    finally:
        for _, seq in launched:
            server.engine.abort(seq)  # a no-op for the finished
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": server.name,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


async def _stream(
    server, launched, ident, created, kind, chat, want_ids, include_usage, request, prompt_tokens
):
    """Server-sent events: one chunk per generated piece, then [DONE]."""
    kind = kind + ".chunk" if chat else kind
    pending = {asyncio.ensure_future(q.get()): i for i, (q, _) in enumerate(launched)}
    completion = [0] * len(launched)

    def chunk(choices, usage=None):
        out = {
            "id": ident,
            "object": kind,
            "created": created,
            "model": server.name,
            "choices": choices,
        }
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    try:
        if chat:
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                    for i in range(len(launched))
                ]
            )
        while pending:
            done, _ = await asyncio.wait(pending, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if await request.is_disconnected():
                    return
                continue
            for future in done:
                index = pending.pop(future)
                event: Event = future.result()
                completion[index] = event.completion_tokens or completion[index] + len(
                    event.token_ids
                )
                if _failed(event.finish_reason):
                    err = {
                        "error": {
                            "message": event.finish_reason,
                            "type": "server_error",
                            "code": 500,
                        }
                    }
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                choice = {"index": index, "finish_reason": event.finish_reason, "logprobs": None}
                if chat:
                    choice["delta"] = (
                        {"content": event.text} if event.text or not event.finish_reason else {}
                    )
                else:
                    choice["text"] = event.text
                if want_ids:
                    choice["token_ids"] = event.token_ids
                yield chunk([choice])
                if not event.finish_reason:
                    pending[asyncio.ensure_future(launched[index][0].get())] = index
        if include_usage:
            yield chunk([], _usage(prompt_tokens, sum(completion)))
        yield "data: [DONE]\n\n"
    finally:
        for future in pending:
            future.cancel()
        for _, seq in launched:
            server.engine.abort(seq)
