"""decoder=server against a real llama.cpp server (llama-cpp-python[server]) on the embedded GGUF file:
llama.cpp's own greedy completions come back through the backend, seeds and token limits are
honoured, a ToT run goes end to end, and bad input ends in one line and exit status 2 with nothing
lost (a server stopped mid-run times out; the rerun resumes)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from llama_server import LlamaServer, free_port
from omegaconf import OmegaConf

from decoding.api.server import ServerEngine, ServerOptions
from decoding.base.errors import BackendError
from decoding.base.prompts import render
from decoding.base.values import GenRequest, Group
from decoding.runtime.models import ModelSpec, load_tokenizer
from tasks import DataSpec, make_task
from tot.collect import collect
from tot.runs.config import RunConfig
from tot.runs.run import run, summary_line
from tot.search.base import GenSettings

REPO = Path(__file__).resolve().parents[1]
# A small run: two depths of two thoughts, short thoughts.
SMALL = ("task.depth=2", "search=bfs", "search.n_thoughts=2", "gen.max_thought_tokens=24", "gen.max_eval_tokens=8")


def server_config(llama: LlamaServer, *overrides: str) -> RunConfig:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["decoder=server", f"server.url={llama.url}", *overrides])
    return RunConfig.from_omegaconf(cfg)


@pytest.fixture(scope="module")
def tokenizer_and_chat():
    return load_tokenizer(ModelSpec())


@pytest.fixture
def engine(llama: LlamaServer, tokenizer_and_chat) -> ServerEngine:
    return ServerEngine(ServerOptions(url=llama.url), *tokenizer_and_chat)


def task_requests(n: int = 2, temperature: float = 0.0) -> list[GenRequest]:
    """Real ToT requests: GSM8K thought prompts (with their reply prefix and stop strings) and an
    evaluation prompt."""
    task = make_task("gsm8k", 4, {})
    problems = task.load(DataSpec(limit=n))
    gen = GenSettings(temperature=temperature, max_thought_tokens=48, max_eval_tokens=24, eval_temperature=temperature)
    requests = [gen.request(task.generator_prompt(p, []), group=Group(p.id), seed=i) for i, p in enumerate(problems)]
    step = ["How many eggs are left? 16 - 3 - 4 = 9 eggs are left."]
    requests.append(gen.request(task.evaluator_prompt(problems[0], step), group=Group("eval"), seed=7, evaluate=True))
    return requests


def test_greedy_outputs_equal_llama_cpps_own(llama: LlamaServer, engine: ServerEngine, tokenizer_and_chat):
    from llama_cpp import Llama

    requests = task_requests()
    done = asyncio.run(engine.agenerate(requests))
    assert engine.model == str(llama.model)  # the one model the server lists
    llm = Llama(model_path=str(llama.model), n_ctx=2048, n_threads=2, verbose=False)
    for r, got in zip(requests, done.results):
        prompt = render(*tokenizer_and_chat, r.prompt, r.prefix)
        own = llm.create_completion(
            prompt.text,
            max_tokens=r.max_new_tokens,
            temperature=0.0,
            top_k=0,
            min_p=0.0,
            repeat_penalty=1.0,
            stop=list(r.stop) or None,
        )
        assert got.text == own["choices"][0]["text"]
        assert got.stats.generated_tokens == own["usage"]["completion_tokens"] > 0
        assert got.stats.prompt_tokens == own["usage"]["prompt_tokens"] == len(prompt.ids)
    assert done.stats.generated_tokens == sum(r.stats.generated_tokens for r in done.results)


def test_logprobs_come_from_the_server(engine: ServerEngine):
    """Asked for, each token's log-probability and its alternatives come back from the server: one
    per token, their texts the reply's, a greedy token the most likely one; a choice, which the API
    cannot score, ends in one line (a server that sends none: tests/test_server_replies.py)."""
    ask = "Count from 1 to 20, separated by commas."
    greedy, sampled = (
        GenRequest(ask, max_new_tokens=12, logprobs=True, top_logprobs=3, **kw) for kw in ({}, {"temperature": 0.9})
    )
    done = asyncio.run(engine.agenerate([greedy, sampled, GenRequest(ask, max_new_tokens=4)]))
    for result in done.results[:2]:
        assert result.logprobs is not None and len(result.logprobs) == result.stats.generated_tokens
        assert "".join(str(t.token) for t in result.logprobs) == result.text
        for t in result.logprobs:
            assert t.logprob <= 0 and 1 <= len(t.top) <= 3
            assert [v for _, v in t.top] == sorted((v for _, v in t.top), reverse=True)
    assert all(t.top[0] == (t.token, t.logprob) for t in done.results[0].logprobs)  # type: ignore[union-attr]
    assert done.results[2].logprobs is None
    with pytest.raises(BackendError, match=r"cannot score given answers .* task.value=sampled"):
        asyncio.run(engine.agenerate([GenRequest(ask, choices=(" 1", " 2"))]))


def test_seeds_limits_and_stops_are_honoured(engine: ServerEngine):
    ask = "Write a short poem about the sea."
    sampled = [GenRequest(ask, max_new_tokens=16, temperature=0.9, seed=s) for s in (1, 1, 2, 3, 4)]
    capped = GenRequest(ask, max_new_tokens=5)
    stopped = GenRequest("Count from 1 to 20, separated by commas.", max_new_tokens=64, stop=("7",))
    done = asyncio.run(engine.agenerate([*sampled, capped, stopped]))
    texts = [r.text for r in done.results[:5]]
    assert texts[0] == texts[1]  # the same seed, the same sample
    assert len(set(texts)) >= 3  # other seeds, other samples
    assert done.results[5].finish_reason == "length" and done.results[5].stats.generated_tokens == 5
    assert done.results[6].finish_reason == "stop" and "7" not in done.results[6].text
    assert done.results[6].text.rstrip().endswith("6,") or "6" in done.results[6].text


def test_a_cancelled_caller_leaves_the_others_running(engine: ServerEngine):
    """Callers share the served model's check: one cancelled while it runs must not cancel it."""
    request = GenRequest("Name a color.", max_new_tokens=4)

    async def two_callers():
        first = asyncio.ensure_future(engine.agenerate([request]))
        second = asyncio.ensure_future(engine.agenerate([request]))
        await asyncio.sleep(0)  # both wait on the model check
        first.cancel()
        return await second

    assert asyncio.run(two_callers()).results[0].stats.generated_tokens > 0


def test_time_shares_add_up_to_the_time_in_flight(engine: ServerEngine):
    async def two_calls() -> tuple[float, float]:
        t0 = time.perf_counter()
        a, b = await asyncio.gather(
            engine.agenerate([GenRequest("Name a color.", max_new_tokens=8, seed=i) for i in range(3)]),
            engine.agenerate([GenRequest("Name a fruit.", max_new_tokens=8, seed=i) for i in range(2)]),
        )
        return a.stats.other_s + b.stats.other_s, time.perf_counter() - t0

    shares, wall = asyncio.run(two_calls())
    assert 0.7 * wall < shares <= wall


def test_tot_run_on_the_server_end_to_end(llama: LlamaServer, tmp_path: Path):
    cfg = server_config(llama, "data.limit=2", *SMALL)
    summary = run(cfg, tmp_path, progress=False)
    assert summary["decoder"] == "server" and summary["n_problems"] == 2
    assert summary["generated_tokens"] > 0 and summary["tokens_per_s"] > 0
    line = summary_line(summary)  # a server reports no forwards: none printed
    assert "decoder=server" in line and "tau" not in line and "rows/forward" not in line
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["bundled-1", "bundled-2"]
    for r in records:
        tree = json.loads((tmp_path / "trees" / f"{r['id']}.json").read_text())
        thoughts = [n for n in tree["nodes"] if n.get("raw")]
        assert thoughts and all(n["tokens"] > 0 for n in thoughts)  # counted by the server's usage
        assert sum(n["tokens"] for n in thoughts) == r["phases"]["generate"]["tokens"]
    rows, _ = collect(tmp_path)
    assert any(row["decoder"] == "server" for row in rows)
    assert run(cfg, tmp_path, progress=False)["n_problems"] == 2  # resumed: nothing to decode


def solve(run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "decoder=server", f"hydra.run.dir={run_dir}", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_bad_server_input_is_one_line_and_exit_2(llama: LlamaServer, tmp_path: Path):
    cases = {
        "unreachable": ([f"server.url=http://127.0.0.1:{free_port()}/v1"], "no server answers at server.url="),
        "model": ([f"server.url={llama.url}", "server.model=nope"], "server.model=nope is not served"),
        "url": (["server.url=localhost:8000"], "server.url='localhost:8000' is not an http(s) URL"),
        "concurrency": (["server.concurrency=0"], "server.concurrency=0 must be >= 1"),
        "option": (["server.nope=1"], "server.nope"),
    }
    with ThreadPoolExecutor(len(cases)) as pool:
        procs = {k: pool.submit(solve, tmp_path / k, "data.limit=1", *args) for k, (args, _) in cases.items()}
    for name, (_, expected) in cases.items():
        proc = procs[name].result()
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert expected in lines[-1], (name, lines[-1])
        assert "Traceback" not in proc.stderr


def test_a_server_stopped_mid_run_times_out_and_the_rerun_resumes(llama: LlamaServer, tmp_path: Path):
    run_dir = tmp_path / "run"
    # Sampled values: no log-probabilities asked for, which llama-cpp-python computes over the whole prompt
    # (2 s for 126 tokens on 2 cores), so that a request's time is the tokens' and 5 s is ample.
    args = [f"server.url={llama.url}", "data.limit=4", "run.concurrency=1", "task.value=sampled", *SMALL]
    cmd = [sys.executable, "-m", "tot.solve", "model=smollm2-135m", "decoder=server", f"hydra.run.dir={run_dir}"]
    cmd += ["server.timeout=5", *args]
    results = run_dir / "results.jsonl"
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (results.exists() and results.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.kill(llama.process.pid, signal.SIGSTOP)  # the server hangs mid-run
        _, stderr = proc.communicate(timeout=120)
    finally:
        os.kill(llama.process.pid, signal.SIGCONT)
    assert proc.returncode == 2, stderr[-2000:]
    assert "did not answer within server.timeout=5.0s" in stderr.strip().splitlines()[-1]
    kept = [json.loads(line)["id"] for line in results.read_text().splitlines()]
    assert 1 <= len(kept) < 4
    again = solve(run_dir, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in results.read_text().splitlines()]
    assert ids[: len(kept)] == kept and sorted(ids) == [f"bundled-{i}" for i in range(1, 5)]


def test_bench_runs_the_server_beside_the_in_process_decoders(llama: LlamaServer):
    from decoding.runtime.models import load_model
    from tot.bench import bench, decoder_configs, table

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(
            config_name="bench",
            overrides=[f"server.url={llama.url}", "data.limit=1", "task.depth=1", "gen.temperature=0", *SMALL[1:]],
        )
    container = OmegaConf.to_container(cfg, resolve=True)
    configs, _ = decoder_configs(container, ["hf", "ar", "server"], has_draft=False)
    result = bench(RunConfig.from_omegaconf(cfg), configs, load_model(ModelSpec()), None, progress=False)
    rows = result["decoders"]
    assert list(rows) == ["hf", "ar", "server"]
    assert result["identity_checked"] == ["hf", "ar"] and result["mismatches"] == []
    assert not result["lossless_checked"]  # the server's outputs are not compared
    assert rows["server"]["tokens"] > 0 and rows["server"]["tokens_per_s"] > 0 and rows["server"]["time_s"] > 0
    assert rows["server"]["clock"] == "wall"  # another process: its steps cannot be counted here
    assert rows["server"]["acceptance_length"] is None and rows["ar"]["acceptance_length"] == 1.0
    assert "speedup_vs_hf" in rows["server"]
    text = table(result)
    line = next(x for x in text.splitlines() if x.startswith("| `server`"))
    assert "| - |" in line and "`server`: outputs follow the server's own numeric path" in text
