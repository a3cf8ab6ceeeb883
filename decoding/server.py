"""`decoder=server`: the search's engine over a serving engine users already run (vLLM, SGLang, TGI,
llama.cpp's server), through the OpenAI-compatible completions API and the official `openai` client.

The prompt is built here, with the model's own tokenizer and chat template, exactly as the
in-process engine builds it (`decoding.core.prompts.render`), and sent as text to `/v1/completions`.
Each request is one completion with n=1 and its own seed: servers differ in what they make of `n`
(llama.cpp's returns one choice), and the search already sends a state's n samples as n requests.
Sampling is plain: top_k=0 (on llama.cpp, whose default is 40) and min_p=0 turn off default filters,
repeat_penalty=1 llama.cpp's default penalty (servers that do not know a field ignore it). What a
server cannot do ends in one error line; the outputs are the server's and follow its numeric path,
so they are not checked against `transformers` as the in-process decoders' are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from decoding.core.errors import BackendError, ConfigError
from decoding.core.prompts import render
from decoding.core.values import Completion, DecodeStats, GenRequest, GenResult

log = logging.getLogger(__name__)

NAME = "server"  # decoder=server
LLAMA_CPP_OWNERS = frozenset({"me", "llamacpp"})  # /v1/models' owned_by of llama.cpp's servers

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
    timeout: float = 600.0  # seconds a request may take, waiting in the server's queue included

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
            self._client = self._openai.AsyncOpenAI(
                base_url=self.options.url, api_key=key, timeout=self.options.timeout, max_retries=0
            )
            self._slots = asyncio.Semaphore(self.options.concurrency)
            self._checked = loop.create_task(self._check_model()) if not self.model_checked else None
            self._loop = loop
        if self._checked is not None:
            await asyncio.shield(self._checked)  # one caller cancelled does not cancel the others' check

    async def _check_model(self) -> None:
        page = await self._call(self._client.models.list())
        served = [m.id for m in page.data]
        # llama.cpp (llama-cpp-python's server says "me", llama-server "llamacpp") filters to top-k 40
        # unless asked for 0; vLLM, SGLang and TGI sample from the whole vocabulary by default and
        # some of their versions refuse 0, so "off" is left unsaid there.
        owners = {getattr(m, "owned_by", "") for m in page.data}
        self._top_k_off = 0 if owners & LLAMA_CPP_OWNERS else None
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
        prompt = render(self.tokenizer, self.use_chat_template, r.prompt, r.prefix)
        assert self._slots is not None
        async with self._slots:
            token = object()
            self._tick(+1, token)
            try:
                reply = await self._call(
                    self._client.completions.create(
                        model=self.model,
                        prompt=prompt.text,
                        max_tokens=r.max_new_tokens,
                        temperature=r.temperature,
                        top_p=r.top_p,
                        seed=r.seed,
                        stop=list(r.stop) or None,
                        n=1,
                        extra_body=self._sampling_extras(r.top_k, prompt.special),
                    )
                )
            finally:
                share = self._tick(-1, token)
        if len(reply.choices) != 1:
            raise BackendError(
                f"the server at {self.options.url} returned {len(reply.choices)} choices for one completion; "
                "it does not serve the completions API as OpenAI specifies it"
            )
        choice, usage = reply.choices[0], reply.usage
        if usage is None:
            raise BackendError(f"the server at {self.options.url} reports no token usage, by which the backend counts")
        self._check_tokens(usage.prompt_tokens, len(prompt.ids))
        cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None) or 0
        stats = DecodeStats(
            generated_tokens=usage.completion_tokens,
            prompt_tokens=usage.prompt_tokens,
            # Servers that do not report their cache hits count every prompt token as computed.
            prompt_tokens_computed=usage.prompt_tokens - cached,
            other_s=share,
            sequences=1,
        )
        reason = "length" if choice.finish_reason == "length" else "stop"
        return GenResult(text=choice.text, token_ids=[], finish_reason=reason, stats=stats)

    def _sampling_extras(self, top_k: int, special: bool) -> dict[str, Any]:
        """Fields beyond OpenAI's: plain sampling on every server (a server ignores what it does
        not know), and whether it adds the tokenizer's special tokens to the prompt text."""
        extras: dict[str, Any] = {"min_p": 0.0, "repeat_penalty": 1.0, "add_special_tokens": special}
        if top_k or self._top_k_off is not None:
            extras["top_k"] = top_k or self._top_k_off
        return extras

    async def _call(self, request: Any) -> Any:
        """A request's reply, or one error line saying what the server did."""
        openai, url = self._openai, self.options.url
        try:
            return await request
        except openai.APITimeoutError:
            raise BackendError(
                f"the server at {url} did not answer within server.timeout={self.options.timeout}s; "
                "raise server.timeout or lower server.concurrency"
            ) from None
        except openai.APIConnectionError:
            raise BackendError(
                f"no server answers at server.url={url}; start one (e.g. python -m llama_cpp.server --model "
                "FILE.gguf) or fix server.url"
            ) from None
        except openai.APIStatusError as e:
            raise BackendError(
                f"the server at {url} refused a request ({e.status_code}: {str(e.message).splitlines()[0][:200]})"
            ) from None

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
