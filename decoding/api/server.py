"""`decoder=server`: the search's engine over a serving engine users already run (vLLM, SGLang, TGI,
llama.cpp's server), through the OpenAI-compatible completions API and the official `openai` client.

The prompt is built here, with the model's own tokenizer and chat template, exactly as the
in-process engine builds it (`decoding.base.prompts.render`), and sent as text to `/v1/completions`.
Each request is one completion with n=1 and its own seed: servers differ in what they make of `n`
(llama.cpp's returns one choice), and the search already sends a state's n samples as n requests.
Sampling is plain: top_k=0 (on llama.cpp, whose default is 40) and min_p=0 turn off default filters,
repeat_penalty=1 llama.cpp's default penalty (servers that do not know a field ignore it). What a
server cannot do ends in one error line; the outputs are the server's and follow its numeric path,
so they are not checked against `transformers` as the in-process decoders' are.

A reply is data from another process and is checked as such: read as it arrives and refused past
what its `max_tokens` can take, bounded in time as a whole by `server.timeout`, and each field the
run uses checked for its type and range; a reply that fails ends in one error line naming the
server, the request and the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

from decoding.base.errors import BackendError, ConfigError
from decoding.base.prompts import render
from decoding.base.values import Completion, DecodeStats, GenRequest, GenResult, TokenLogprob, request_list

log = logging.getLogger(__name__)

NAME = "server"  # decoder=server
LLAMA_CPP_OWNERS = frozenset({"me", "llamacpp"})  # /v1/models' owned_by of llama.cpp's servers

# A completion's reply may take what its max_tokens can hold and no more, so a server that sends
# without end is cut off: a token is at most a few hundred bytes of text (the longest in common
# vocabularies, runs of spaces or dashes, stay under 256) and JSON may write each byte as \u00XX
# (6 bytes), so 2 KiB a token is more than any honest reply needs; 64 KiB more holds what servers
# put around the text (ids, usage, llama.cpp's timings).
REPLY_BYTES_PER_TOKEN = 2048
REPLY_ENVELOPE_BYTES = 64 * 1024
MODELS_BYTES = 4 * 1024 * 1024  # a model list: a router lists some hundreds of models with their metadata
ERROR_BYTES = 16 * 1024  # an error reply: only its first line is shown
_MISSING = object()  # a field a reply leaves out (null is a value: it is shown as null)
T = TypeVar("T")

# The completions API reports log-probabilities of what the server generates, never of given text.
CHOICES_REFUSED = (
    "decoder=server cannot score given answers (GenRequest.choices): the completions API returns log-probabilities "
    "of generated tokens only; use task.value=sampled with the server, or an in-process decoder"
)
# The server is sent text: it cannot continue a finished sequence's very tokens.
FOLLOW_UPS_REFUSED = (
    "decoder=server sends text and reuses nothing, so it cannot continue a finished reply with a new turn: "
    "use task.evaluator=separate with the server, or an in-process decoder"
)


@dataclass(frozen=True)
class ServerOptions:
    """The `server:` namespace."""

    url: str = "http://127.0.0.1:8000/v1"  # the API's base URL, /v1 included
    model: str | None = None  # the served model's name; null: the one model the server lists
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the API key (unset: none)
    concurrency: int = 16  # requests in flight at once (vLLM and SGLang batch them; llama.cpp queues them)
    timeout: float = 600.0  # seconds a whole request may take: the server's queue and every byte of its reply

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            _ = parts.port  # a port that is no number raises here
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"server.url={self.url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000/v1")
        if self.concurrency < 1:
            raise ConfigError(f"server.concurrency={self.concurrency} must be >= 1")
        if self.timeout <= 0:
            raise ConfigError(f"server.timeout={self.timeout} must be a positive number of seconds")


class BadReply(ValueError):
    """A reply that is not what the API promises; the message names the field and what it holds."""


class BadStatus(ValueError):
    """An error status, with the first line of the reply's message."""


@dataclass(frozen=True)
class Call:
    """A request as an error line names it, and the most bytes its reply may take."""

    method: str
    path: str  # under server.url
    limit: int
    asked: str = ""  # what it asked for, e.g. "max_tokens=24, seed=3"

    def __str__(self) -> str:
        return f"{self.method} {self.path}" + (f" ({self.asked})" if self.asked else "")


@dataclass(frozen=True)
class Reply:
    """What a run uses of a completion, each field checked."""

    text: str
    finish_reason: Literal["length", "stop"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the server took from its cache (0 where it reports none)
    logprobs: list[TokenLogprob] | None = None  # asked for: each token's, by its text (no ids come back)


def reply_limit(max_tokens: int) -> int:
    return REPLY_ENVELOPE_BYTES + REPLY_BYTES_PER_TOKEN * max_tokens


class ServerEngine:
    """`agenerate` over a server's `/v1/completions`; the cost of a call is its requests' tokens (the
    server's `usage`) and its share of the time requests were in flight (shared equally by the
    requests in flight at each moment, so the shares of all calls add up to the time the server
    was busy with the run)."""

    def __init__(self, options: ServerOptions, tokenizer: Any, use_chat_template: bool) -> None:
        try:
            import openai
        except ImportError:
            raise BackendError("decoder=server needs the openai package: pip install openai") from None
        self.options, self.tokenizer, self.use_chat_template = options, tokenizer, use_chat_template
        self._openai = openai
        self.model = options.model
        self.model_checked = False
        self._top_k_off: int | None = None  # what says "no top-k filter" to this server (None: leave it out)
        self._checked: asyncio.Task[None] | None = None
        self._warned_tokens = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._live: dict[object, float] = {}  # request -> its share of the time so far
        self._last = 0.0

    def peak_cache_bytes(self) -> int:
        return 0  # the server's memory is its own

    async def agenerate(self, requests: list[GenRequest]) -> Completion:
        requests = request_list("agenerate", requests)
        if not requests:
            return Completion([], DecodeStats())
        await self._connect()
        done = await asyncio.gather(*(self._complete(r) for r in requests))
        stats = DecodeStats()
        for result in done:
            stats += result.stats
        return Completion(list(done), stats)

    async def _connect(self) -> None:
        """A client (and a bound on requests in flight) for the running event loop, and, once, the
        served model's name checked against what the server lists."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the client's connections belong to one loop
            key = os.environ.get(self.options.api_key_env, "") or "EMPTY"
            # No timeout per read: server.timeout bounds each whole request (_fetch).
            http = self._openai.DefaultAsyncHttpxClient(timeout=None, event_hooks={"response": [_refuse_status]})
            self._client = self._openai.AsyncOpenAI(
                base_url=self.options.url, api_key=key, timeout=None, max_retries=0, http_client=http
            )
            self._slots = asyncio.Semaphore(self.options.concurrency)
            self._checked = loop.create_task(self._check_model()) if not self.model_checked else None
            self._loop = loop
        if self._checked is not None:
            await asyncio.shield(self._checked)  # one caller cancelled does not cancel the others' check

    async def _check_model(self) -> None:
        call = Call("GET", "/models", MODELS_BYTES)
        owners = await self._fetch(call, self._client.models.with_streaming_response.list, parse_models)
        served = list(owners)
        # llama.cpp (llama-cpp-python's server says "me", llama-server "llamacpp") filters to top-k 40
        # unless asked for 0; vLLM, SGLang and TGI sample from the whole vocabulary by default and
        # some of their versions refuse 0, so "off" is left unsaid there.
        self._top_k_off = 0 if set(owners.values()) & LLAMA_CPP_OWNERS else None
        if not self.model:
            if len(served) != 1:
                raise BackendError(
                    f"the server at server.url={self.options.url} serves {len(served)} models "
                    f"({', '.join(served) or 'none'}); say which with server.model=<name>"
                )
            self.model = served[0]
        elif self.model not in served:
            raise BackendError(
                f"server.model={self.model} is not served at server.url={self.options.url} (it serves: "
                f"{', '.join(served) or 'nothing'}); set server.model to one of them"
            )
        self.model_checked = True

    async def _complete(self, r: GenRequest) -> GenResult:
        if r.context:
            raise BackendError(FOLLOW_UPS_REFUSED)
        if r.choices:
            raise BackendError(CHOICES_REFUSED)
        prompt = render(self.tokenizer, self.use_chat_template, r.prompt, r.prefix)
        asked = f"max_tokens={r.max_new_tokens}, seed={r.seed}" + (f", logprobs={r.top_logprobs}" if r.logprobs else "")
        call = Call("POST", "/completions", reply_limit(r.max_new_tokens), asked)
        send = partial(
            self._client.completions.with_streaming_response.create,
            model=self.model,
            prompt=prompt.text,
            max_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            seed=r.seed,
            stop=list(r.stop) or None,
            n=1,
            logprobs=r.top_logprobs if r.logprobs else None,  # the completions API's count of alternatives
            extra_body=self._sampling_extras(r.top_k, prompt.special),
        )
        assert self._slots is not None
        async with self._slots:
            token = object()
            self._tick(+1, token)
            try:
                parse = partial(parse_completion, max_tokens=r.max_new_tokens, logprobs=r.logprobs)
                reply = await self._fetch(call, send, parse)
            finally:
                share = self._tick(-1, token)
        self._check_tokens(reply.prompt_tokens, len(prompt.ids))
        stats = DecodeStats(
            generated_tokens=reply.completion_tokens,
            prompt_tokens=reply.prompt_tokens,
            # Servers that do not report their cache hits count every prompt token as computed.
            prompt_tokens_computed=reply.prompt_tokens - reply.cached_tokens,
            other_s=share,
            sequences=1,
        )
        logprobs = None if reply.logprobs is None else [replace(t, top=t.top[: r.top_logprobs]) for t in reply.logprobs]
        return GenResult(reply.text, [], reply.finish_reason, stats, logprobs=logprobs)

    def _sampling_extras(self, top_k: int, special: bool) -> dict[str, Any]:
        """Fields beyond OpenAI's: plain sampling on every server (a server ignores what it does
        not know), and whether it adds the tokenizer's special tokens to the prompt text."""
        extras: dict[str, Any] = {"min_p": 0.0, "repeat_penalty": 1.0, "add_special_tokens": special}
        if top_k or self._top_k_off is not None:
            extras["top_k"] = top_k or self._top_k_off
        return extras

    async def _fetch(self, call: Call, send: Callable[[], Any], parse: Callable[[Any], T]) -> T:
        """A request's reply, read whole within server.timeout (sending, the server's queue and every
        byte of the reply) and `call.limit` bytes, and parsed; or one error line naming the server,
        the request and what was wrong."""
        url = self.options.url
        try:
            body = await asyncio.wait_for(_exchange(call, send), self.options.timeout)
            return parse(_json(body))
        except asyncio.TimeoutError:
            raise BackendError(
                f"the server at {url} did not answer within server.timeout={self.options.timeout}s to {call}; "
                "raise server.timeout or lower server.concurrency"
            ) from None
        except self._openai.APIConnectionError:
            raise BackendError(
                f"no server answers at server.url={url}; start one (e.g. python -m llama_cpp.server --model "
                "FILE.gguf) or fix server.url"
            ) from None
        except BadStatus as e:
            raise BackendError(f"the server at {url} refused {call} with {e}") from None
        except BadReply as e:
            raise BackendError(f"the server at {url} sent a bad reply to {call}: {e}") from None

    def _tick(self, change: int, request: object) -> float:
        """Share the time since the last start or end of a request among the requests in flight;
        returns the share `request` has gathered (when it ends)."""
        now = time.perf_counter()
        if self._live:
            part = (now - self._last) / len(self._live)
            for k in self._live:
                self._live[k] += part
        self._last = now
        if change > 0:
            self._live[request] = 0.0
            return 0.0
        return self._live.pop(request)

    def _check_tokens(self, served: int, local: int) -> None:
        if served != local and not self._warned_tokens:
            self._warned_tokens = True
            log.warning(
                "the server read a prompt as %d tokens, the local tokenizer as %d: model.path should name the "
                "served model (its tokenizer and chat template build the prompts)",
                served,
                local,
            )


async def _exchange(call: Call, send: Callable[[], Any]) -> bytes:
    async with send() as response:
        return await _read(response.iter_bytes(), call.limit)


async def _read(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """A body read as it arrives (decoded: a compressed reply counts as what it unpacks to), refused
    once past `limit` bytes."""
    body = bytearray()
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return bytes(body)
        except Exception as e:  # the HTTP library's read errors (its module differs across SDK versions)
            raise BadReply(f"the connection broke mid-reply ({type(e).__name__}: {_first_line(str(e))})") from None
        body += chunk
        if len(body) > limit:
            raise BadReply(f"it runs past {limit} bytes, more than what was asked for can take")


async def _refuse_status(response: Any) -> None:
    """The HTTP client's response hook: an error status is refused here, its body read no further
    than ERROR_BYTES (the SDK would read it whole, however long)."""
    if response.status_code < 400:
        return
    body = bytearray()
    with contextlib.suppress(Exception):  # a body cut short: its status says enough
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) >= ERROR_BYTES:
                break
    raise BadStatus(f"status {response.status_code}: {_error_message(bytes(body[:ERROR_BYTES]))}")


def _error_message(body: bytes) -> str:
    """An error reply's message (OpenAI's error.message, or a message or FastAPI's detail, else its
    text): its first line, cut to 200 characters."""
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        found = [error.get("message") if isinstance(error, dict) else error, data.get("message"), data.get("detail")]
        text = next((x for x in found if isinstance(x, str)), text)
    return _first_line(text) or "no message"


def _first_line(text: str, width: int = 200) -> str:
    lines = text.strip().splitlines()
    return lines[0][:width] if lines else ""


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BadReply(f"it is not JSON ({str(e)[:100]}; it starts {body[:40]!r})") from None


def parse_completion(data: Any, max_tokens: int, logprobs: bool = False) -> Reply:
    """The fields a run uses of a `/v1/completions` reply, each checked for its type and range."""
    reply = _object(data, "the reply")
    choices = reply.get("choices", _MISSING)
    if not isinstance(choices, list) or len(choices) != 1:
        raise BadReply(f"choices is {_show(choices)}, not a list of the one completion asked for")
    choice = _object(choices[0], "choices[0]")
    text = _string(choice.get("text", _MISSING), "choices[0].text")
    reason = _string(choice.get("finish_reason"), "choices[0].finish_reason", optional=True)
    usage = _object(reply.get("usage", _MISSING), "usage")  # the token counts the run reports
    prompt = _count(usage.get("prompt_tokens", _MISSING), "usage.prompt_tokens")
    generated = _count(usage.get("completion_tokens", _MISSING), "usage.completion_tokens", high=max_tokens)
    details = usage.get("prompt_tokens_details")
    cached = 0
    if details is not None:
        cached_tokens = _object(details, "usage.prompt_tokens_details").get("cached_tokens")
        if cached_tokens is not None:
            cached = _count(cached_tokens, "usage.prompt_tokens_details.cached_tokens", high=prompt)
    tokens = parse_logprobs(choice.get("logprobs"), generated) if logprobs else None
    return Reply(text, "length" if reason == "length" else "stop", prompt, generated, cached, tokens)


def parse_logprobs(data: Any, generated: int) -> list[TokenLogprob]:
    """The completions API's `logprobs` object (tokens, token_logprobs, top_logprobs: a dict per
    token, the token itself among its entries) as one entry per generated token, alternatives most
    likely first; a server that sends none was not started to compute them."""
    if data is None:
        raise BadReply(
            "choices[0].logprobs is null though log-probabilities were asked for: this server does not return "
            "them (llama-cpp-python's needs --logits_all true)"
        )
    fields = _object(data, "choices[0].logprobs")
    tokens, values = fields.get("tokens", _MISSING), fields.get("token_logprobs", _MISSING)
    tops = fields.get("top_logprobs") or [None] * (len(tokens) if isinstance(tokens, list) else 0)
    if not isinstance(tokens, list) or not isinstance(values, list) or not len(tokens) == len(values) == len(tops):
        raise BadReply(f"choices[0].logprobs holds {_show(data)}, not a token list with a log-probability each")
    if len(tokens) > generated + 1:
        raise BadReply(f"choices[0].logprobs has {len(tokens)} tokens for {generated} generated")
    out = []
    for i, (token, value, top) in enumerate(zip(tokens, values, tops)):
        where = f"choices[0].logprobs[{i}]"
        if not isinstance(token, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadReply(f"{where} is {_show(token)}: {_show(value)}, not a token and its log-probability")
        pairs = [] if top is None else list(_object(top, f"{where}.top_logprobs").items())
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for _, v in pairs):
            raise BadReply(f"{where}.top_logprobs holds {_show(top)}, not tokens with log-probabilities")
        pairs.sort(key=lambda kv: -kv[1])
        out.append(TokenLogprob(token, float(value), tuple((k, float(v)) for k, v in pairs)))
    return out


def parse_models(data: Any) -> dict[str, str]:
    """A `/v1/models` reply's models: name -> owner ("" where it names none)."""
    models = _object(data, "the reply").get("data", _MISSING)
    if not isinstance(models, list):
        raise BadReply(f"data is {_show(models)}, not a list of models")
    served = {}
    for i, entry in enumerate(models):
        model = _object(entry, f"data[{i}]")
        name = _string(model.get("id", _MISSING), f"data[{i}].id")
        if not name:
            raise BadReply(f"data[{i}].id is empty, not a model's name")
        served[name] = _string(model.get("owned_by"), f"data[{i}].owned_by", optional=True)
    return served


def _object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadReply(f"{path} is {_show(value)}, not an object")
    return value


def _string(value: Any, path: str, optional: bool = False) -> str:
    if optional and (value is None or value is _MISSING):
        return ""
    if not isinstance(value, str):
        raise BadReply(f"{path} is {_show(value)}, not a string")
    return value


def _count(value: Any, path: str, high: int | None = None) -> int:
    """A token count: a whole number from 0 (to `high`, what was asked for, where there is a bound)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (high is None or value <= high):
        return value
    bound = "of 0 or more" if high is None else f"from 0 to {high}"
    raise BadReply(f"{path} is {_show(value)}, not a token count {bound}")


def _show(value: Any) -> str:
    """A value as an error line shows it: its JSON, cut short."""
    if value is _MISSING:
        return "missing"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
