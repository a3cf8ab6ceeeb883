"""decoder=server against a server that answers badly (tests/bad_server.py): each bad reply ends the
run with one line naming the server, the request and the field, exit status 2, no traceback, within
a bound in time, and nothing untrue stored. The command-line cases are subprocesses (a few seconds of
imports each), so they all start together in one module fixture and each test checks its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from bad_server import FLOOD_BYTES, BadServer, bad_server
from test_cli import REPO, subprocess_env

from decoding.api.server import BadReply, Reply, ServerEngine, ServerOptions, parse_completion, parse_models
from decoding.base.errors import BackendError
from decoding.base.values import GenRequest

SMALL = ("model=smollm2-135m", "data.limit=1", "task.depth=1", "search=bfs", "search.n_thoughts=2")
SMALL += ("gen.max_thought_tokens=8", "gen.max_eval_tokens=4")
TIMEOUT = 2  # server.timeout of the trickle case
ENDS_WITHIN_S = 20  # from the request of the first bad reply to the run's end (with other jobs on the cores)

# way -> what the error line says after naming the server and the request
CASES = {
    "cut_connection": "the connection broke mid-reply (RemoteProtocolError",
    "cut_json": "it is not JSON (Unterminated string starting at",
    "null_text": "choices[0].text is null, not a string",
    "null_tokens": "usage.completion_tokens is null, not a token count from 0 to 8",
    "text_tokens": 'usage.prompt_tokens is "12", not a token count of 0 or more',
    "negative_tokens": "usage.completion_tokens is -120, not a token count from 0 to 8",
    "html": "it is not JSON (Expecting value: line 1 column 1 (char 0); it starts b'<!DOCTYPE html>",
    "models": "data[0].id is 5, not a string",
    "trickle": f"did not answer within server.timeout={TIMEOUT}",
    "oversized": "it runs past 81920 bytes, more than what was asked for can take",
    "error_flood": "with status 500: internal error",
}
# The kinds the issue found, each through the command line (the others are checked in-process).
CLI_WAYS = [way for way in CASES if way not in ("cut_connection", "error_flood")]


def request_named(way: str) -> str:
    return "GET /models" if way == "models" else "POST /completions (max_tokens=8, seed="


def options(way: str) -> dict[str, float]:
    return {"timeout": TIMEOUT} if way == "trickle" else {}


@dataclass(frozen=True)
class Ran:
    proc: subprocess.CompletedProcess
    run_dir: Path
    ended: float  # time.monotonic() at its end


@pytest.fixture(scope="module")
def server() -> Iterator[BadServer]:
    with bad_server() as server:
        yield server


@pytest.fixture(scope="module")
def runs(server: BadServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    root = tmp_path_factory.mktemp("bad_server")

    def launch(way: str) -> Ran:
        run_dir = root / way
        cmd = [sys.executable, "-m", "tot.solve", "decoder=server", f"server.url={server.url(way)}", *SMALL]
        cmd += [f"server.{k}={v}" for k, v in options(way).items()] + [f"hydra.run.dir={run_dir}"]
        proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
        return Ran(proc, run_dir, time.monotonic())

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(zip(CLI_WAYS, pool.map(launch, CLI_WAYS)))


@pytest.mark.parametrize("way", CLI_WAYS)
def test_a_bad_reply_is_one_line_and_exit_2(server: BadServer, runs: dict[str, Ran], way: str):
    ran = runs[way]
    took = ran.ended - server.arrived[way]
    report = f"exit {ran.proc.returncode}, {took:.1f}s after the bad request\nstderr:\n{ran.proc.stderr[-4000:]}"
    assert ran.proc.returncode == 2, report
    assert "Traceback" not in ran.proc.stderr, report
    errors = [line for line in ran.proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, report
    assert errors[0].startswith(f"error: the server at {server.url(way)} "), report
    assert request_named(way) in errors[0] and CASES[way] in errors[0], report
    assert took < ENDS_WITHIN_S, report
    # Nothing untrue stored: the first reply was bad, so no problem was finished.
    results = ran.run_dir / "results.jsonl"
    assert not results.exists() or results.read_text() == "", report


@pytest.mark.parametrize("way", list(CASES))
def test_a_bad_reply_is_a_user_error_naming_it(server: BadServer, tokenizer, way: str):
    engine = ServerEngine(ServerOptions(url=server.url(way), **options(way)), tokenizer, False)
    started = time.monotonic()
    with pytest.raises(BackendError) as caught:
        asyncio.run(engine.agenerate([GenRequest("Name a color.", max_new_tokens=8)]))
    line = str(caught.value)
    assert line.startswith(f"the server at {server.url(way)} ") and len(line.splitlines()) == 1
    assert request_named(way) in line and CASES[way] in line
    assert time.monotonic() - started < TIMEOUT + 3


@pytest.mark.parametrize("way", ["oversized", "error_flood"])
def test_a_flood_is_read_no_further_than_its_bound(server: BadServer, tokenizer, way: str):
    """A 50 MB reply to an 8-token request (tests/bad_server.py) is cut off: the client holds a small part of it."""
    engine = ServerEngine(ServerOptions(url=server.url(way)), tokenizer, False)
    tracemalloc.start()
    try:
        with pytest.raises(BackendError):
            asyncio.run(engine.agenerate([GenRequest("Name a color.", max_new_tokens=8)]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < FLOOD_BYTES / 20


def test_a_good_reply_is_counted_as_the_server_reports_it(server: BadServer, tokenizer):
    engine = ServerEngine(ServerOptions(url=server.url("good")), tokenizer, False)
    done = asyncio.run(engine.agenerate([GenRequest("Name a color.", max_new_tokens=8)]))
    got = done.results[0]
    assert (got.text, got.finish_reason) == ("ok", "length")
    assert (got.stats.generated_tokens, got.stats.prompt_tokens, got.stats.prompt_tokens_computed) == (2, 12, 8)
    assert engine.model == "bad-model" and engine._top_k_off == 0  # owned by "me": llama.cpp's server


def reply(**fields: object) -> dict:
    usage = {"prompt_tokens": 10, "completion_tokens": 4, **fields.pop("usage", {})}  # type: ignore[dict-item]
    choice = {"text": "ok", "finish_reason": "stop", **fields.pop("choice", {})}  # type: ignore[dict-item]
    return {"choices": [choice], "usage": usage, **fields}


@pytest.mark.parametrize(
    "data, expected",
    [
        ([], "the reply is [], not an object"),
        (reply(choices=[]), "choices is [], not a list of the one completion asked for"),
        (reply(choices=[{}, {}]), "choices is [{}, {}], not a list of the one"),
        (reply(choice={"text": 5}), "choices[0].text is 5, not a string"),
        (reply(choice={"finish_reason": 1}), "choices[0].finish_reason is 1, not a string"),
        ({**reply(), "usage": None}, "usage is null, not an object"),
        ({"choices": reply()["choices"]}, "usage is missing, not an object"),
        (reply(usage={"prompt_tokens": True}), "usage.prompt_tokens is true, not a token count of 0 or more"),
        (reply(usage={"prompt_tokens": 1.5}), "usage.prompt_tokens is 1.5, not a token count"),
        (reply(usage={"completion_tokens": 9}), "usage.completion_tokens is 9, not a token count from 0 to 8"),
        (
            reply(usage={"prompt_tokens_details": {"cached_tokens": 11}}),
            "usage.prompt_tokens_details.cached_tokens is 11, not a token count from 0 to 10",
        ),
        (reply(usage={"prompt_tokens_details": []}), "usage.prompt_tokens_details is [], not an object"),
    ],
)
def test_each_field_of_a_completion_is_checked(data: object, expected: str):
    with pytest.raises(BadReply) as caught:
        parse_completion(data, max_tokens=8)
    assert str(caught.value).startswith(expected)


LOGPROBS = {"tokens": ["o", "k"], "token_logprobs": [-0.5, -1.0], "top_logprobs": [{"o": -0.5, "a": -2.0}, {"k": -1.0}]}


@pytest.mark.parametrize(
    "logprobs, expected",
    [
        (None, "choices[0].logprobs is null though log-probabilities were asked for: this server does not return"),
        ([], "choices[0].logprobs is [], not an object"),
        ({**LOGPROBS, "token_logprobs": [-0.5]}, "choices[0].logprobs holds"),
        ({**LOGPROBS, "token_logprobs": [-0.5, "x"]}, 'choices[0].logprobs[1] is "k": "x", not a token and its'),
        ({**LOGPROBS, "top_logprobs": [{"o": None}, None]}, "choices[0].logprobs[0].top_logprobs holds"),
    ],
)
def test_logprobs_of_a_completion_are_checked(logprobs: object, expected: str):
    data = reply(choice={"logprobs": logprobs})
    assert parse_completion(data, max_tokens=8).logprobs is None  # not asked: not read
    with pytest.raises(BadReply) as caught:
        parse_completion(data, max_tokens=8, logprobs=True)
    assert str(caught.value).startswith(expected)
    good = parse_completion(reply(choice={"logprobs": LOGPROBS}), max_tokens=8, logprobs=True).logprobs
    assert good is not None and [(t.token, t.logprob, t.top) for t in good] == [
        ("o", -0.5, (("o", -0.5), ("a", -2.0))),
        ("k", -1.0, (("k", -1.0),)),
    ]


def test_a_checked_completion_keeps_what_the_run_uses():
    got = parse_completion(reply(usage={"prompt_tokens_details": {"cached_tokens": None}}), max_tokens=8)
    assert got == Reply(text="ok", finish_reason="stop", prompt_tokens=10, completion_tokens=4, cached_tokens=0)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"object": "list"}, "data is missing, not a list of models"),
        ({"data": {"id": "m"}}, 'data is {"id": "m"}, not a list of models'),
        ({"data": ["m"]}, 'data[0] is "m", not an object'),
        ({"data": [{"id": ""}]}, "data[0].id is empty, not a model's name"),
        ({"data": [{"id": "m", "owned_by": 3}]}, "data[0].owned_by is 3, not a string"),
    ],
)
def test_a_malformed_model_list_is_named(data: object, expected: str):
    with pytest.raises(BadReply) as caught:
        parse_models(data)
    assert str(caught.value) == expected


def test_a_model_list_gives_names_and_owners():
    data = {"data": [{"id": "a", "owned_by": "me"}, {"id": "b", "owned_by": None}, {"id": "c"}]}
    assert parse_models(data) == {"a": "me", "b": "", "c": ""}


@pytest.mark.parametrize("given", ["Name a color.", GenRequest("Name a color.")])
def test_the_server_backend_says_what_it_takes_before_asking(tokenizer, given):
    """The same check of a call's requests as the engine's: nothing is sent (no server runs here)."""
    engine = ServerEngine(ServerOptions(url="http://127.0.0.1:9"), tokenizer, False)
    with pytest.raises(TypeError, match=r"^agenerate takes a list of GenRequest"):
        asyncio.run(engine.agenerate(given))
