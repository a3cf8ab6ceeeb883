"""tot.runs.run.run on the bundled problems with a fake engine: output files, resume after a kill, config checks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import AwaitableFake, reply
from hydra import compose, initialize_config_module

from decoding.base.errors import BackendError
from decoding.base.values import DecodeStats, GenRequest, GenResult
from tasks.base import DataError
from tasks.gsm8k import FINAL_PREFIX, SCORE_PREFIX
from tot.runs.config import ConfigError, RunConfig
from tot.runs.run import build_task, run, summary_line
from tot.search.bfs import BFSSettings

IDS = [f"bundled-{i}" for i in range(1, 7)]
GOLD_12 = {"bundled-1", "bundled-6"}  # the fake always answers 12
# Per problem (depth 4, n=3, b=1): 4 thought calls of 3 requests x 3 tokens, 4 evaluation calls of 3 x 2 tokens.
GEN_TOKENS, EVAL_TOKENS = 4 * 3 * 3, 4 * 3 * 2


def make_config(*overrides: str) -> RunConfig:
    """The run's config; GSM8K's ToT-BFS (not its default vote) with SEED's sub-question thoughts (depth 4)
    valued by sampled scores, which the fake engines answer: these tests are about a run's mechanics,
    tests/test_gsm8k.py about the prompts, tests/test_value.py about the value modes."""
    task = next((o.split("=", 1)[1] for o in overrides if o.startswith("task=")), "gsm8k")
    sub = []
    for key, value in (("search", "bfs"), ("task.thoughts", "subquestions"), ("task.value", "sampled")):
        if task == "gsm8k" and not any(o.startswith(f"{key}=") for o in overrides):
            sub.append(f"{key}={value}")
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, *sub])
    return RunConfig.from_omegaconf(cfg)


class FakeEngine(AwaitableFake):
    """Deterministic replies: thoughts of 3 tokens, "The answer is 12." at the last step, "Score: 7"."""

    def __init__(self) -> None:
        self.calls = 0
        self.problems: list[str] = []  # problem ids in the order their first request arrived
        self.last_stats = DecodeStats()

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        self.calls += 1
        pid = requests[0].group.problem
        if pid not in self.problems:
            self.problems.append(pid)
        results = []
        for r in requests:
            if r.prefix == SCORE_PREFIX:
                results.append(reply(" 7, it helps.", [4, 5]))
            elif r.prefix == FINAL_PREFIX:
                results.append(reply(" 12.", [1, 2, 3]))
            else:
                results.append(reply(" How many? Sub-answer: 3 + 4 = 7.", [1, 2, 3]))
        n = sum(len(x.token_ids) for x in results)
        self.last_stats = DecodeStats(generated_tokens=n, target_forwards=2, verify_steps=n, verify_s=0.001)
        return results


class Killed(RuntimeError):
    """Stands for the process being killed mid-problem."""


class KilledEngine(FakeEngine):
    """Dies in the middle of a problem: at its `at`-th call for that problem (a kill between calls)."""

    def __init__(self, problem: str, at: int) -> None:
        super().__init__()
        self.problem, self.at, self.seen = problem, at, 0

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        if requests[0].group.problem == self.problem:
            self.seen += 1
            if self.seen == self.at:
                raise Killed("killed")
        return super().generate(requests)


def read_results(out: Path) -> list[dict]:
    text = (out / "results.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def check_complete(out: Path, ids: list[str] = IDS) -> dict:
    records = read_results(out)
    assert sorted(r["id"] for r in records) == sorted(ids)  # each id exactly once
    for r in records:
        assert r["correct"] == (r["id"] in GOLD_12)
        assert r["tokens"] == GEN_TOKENS + EVAL_TOKENS
        assert (out / "trees" / f"{r['id']}.json").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_problems"] == len(ids)
    assert summary["generated_tokens"] == len(ids) * (GEN_TOKENS + EVAL_TOKENS)
    assert summary["accuracy"] == pytest.approx(len(GOLD_12 & set(ids)) / len(ids))
    return summary


def assert_as_uninterrupted(cfg: RunConfig, out: Path, whole: Path) -> None:
    """The resumed run's results (but for timings) and trees equal those of a run never killed."""
    run(cfg, whole, engine=FakeEngine(), progress=False)
    strip = {"wall_s", "wall_share_s", "phases"}
    by_id = {r["id"]: {k: v for k, v in r.items() if k not in strip} for r in read_results(whole)}
    assert {r["id"]: {k: v for k, v in r.items() if k not in strip} for r in read_results(out)} == by_id
    for pid in IDS:
        assert (out / "trees" / f"{pid}.json").read_text() == (whole / "trees" / f"{pid}.json").read_text()


def test_run_writes_outputs(tmp_path):
    cfg = make_config("run.concurrency=1")  # problems one by one: results in order
    assert (
        cfg.task == "gsm8k"
        and build_task(cfg).depth == 4
        and cfg.search_settings == BFSSettings(n_thoughts=3, breadth=1)
    )
    engine = FakeEngine()
    out = tmp_path / "run"
    summary = run(cfg, out, engine=engine, progress=False)
    assert engine.problems == IDS
    assert engine.calls == 6 * 6 * 4  # per depth: 3 thoughts and 3 evaluations, each its own call

    records = read_results(out)
    assert [r["id"] for r in records] == IDS
    first = records[0]
    assert {"id", "question", "answer", "gold", "correct", "tokens", "wall_s"} <= set(first)
    assert first["question"].startswith("A baker makes 24 muffins")
    assert (first["answer"], first["gold"], first["correct"]) == ("12", "12", True)
    assert (records[1]["answer"], records[1]["gold"], records[1]["correct"]) == ("12", "110", False)
    assert first["wall_s"] >= 0
    assert first["phases"]["generate"]["tokens"] == GEN_TOKENS
    assert first["phases"]["evaluate"]["tokens"] == EVAL_TOKENS

    on_disk = check_complete(out)
    assert on_disk == json.loads(json.dumps(summary))
    for key in (
        "task",
        "search",
        "decoder",
        "model",
        "n_problems",
        "accuracy",
        "generated_tokens",
        "target_forwards",
        "acceptance_length",
        "tokens_per_s",
        "wall_s",
        "phases",
    ):
        assert key in summary, key
    assert (summary["task"], summary["search"], summary["decoder"], summary["model"]) == (
        "gsm8k",
        "bfs",
        "seed_stand",  # the default decoder
        "smollm2-135m",
    )
    assert summary["accuracy"] == pytest.approx(2 / 6)
    assert summary["target_forwards"] == 6 * 24 * 2
    assert summary["acceptance_length"] == 1.0
    assert summary["tokens_per_s"] > 0
    # The run's wall time: the problems' shares since the one before finished.
    assert summary["wall_s"] == pytest.approx(sum(r["wall_share_s"] for r in records))
    assert summary["concurrency"] == 1
    assert summary["phases"]["generate"]["tokens"] == 6 * GEN_TOKENS
    assert summary["phases"]["evaluate"]["tokens"] == 6 * EVAL_TOKENS
    for phase in ("generate", "evaluate"):
        assert summary["phases"][phase]["engine_s"] >= 0
    assert "accuracy 0.333 (2/6; strict 0.333, flexible 0.333)" in summary_line(summary)

    tree = json.loads((out / "trees" / "bundled-1.json").read_text())
    assert len(tree["nodes"]) == 1 + 4 * 3
    assert sum(n["answer"] for n in tree["nodes"]) == 1 + 4
    assert not list(out.glob("**/*.tmp"))

    # A second start in the finished directory does no work and keeps the results.
    again = FakeEngine()
    assert run(cfg, out, engine=again, progress=False)["n_problems"] == 6
    assert again.calls == 0
    assert len(read_results(out)) == 6


def test_run_limit_offset(tmp_path):
    # The fake engine writes every sibling alike: search.distinct=false keeps both copies growing.
    cfg = make_config(
        "data.limit=2",
        "data.offset=3",
        "search.n_thoughts=2",
        "search.breadth=2",
        "task.depth=2",
        "search.distinct=false",
    )
    engine = FakeEngine()
    summary = run(cfg, tmp_path, engine=engine, progress=False)
    assert engine.problems == ["bundled-4", "bundled-5"]
    assert [r["id"] for r in read_results(tmp_path)] == ["bundled-4", "bundled-5"]
    assert summary["n_problems"] == 2
    tree = json.loads((tmp_path / "trees" / "bundled-4.json").read_text())
    assert len(tree["nodes"]) == 1 + 2 + 2 * 2


def test_resume_after_kill(tmp_path):
    cfg = make_config("run.concurrency=1")  # problems one by one: results in order
    out = tmp_path / "run"
    killed = KilledEngine("bundled-3", at=5)  # in problem 3's depth-3 thought generation
    with pytest.raises(Killed):
        run(cfg, out, engine=killed, progress=False)
    assert [r["id"] for r in read_results(out)] == IDS[:2]
    assert json.loads((out / "summary.json").read_text())["n_problems"] == 2
    assert not (out / "trees" / "bundled-3.json").exists()

    counting = FakeEngine()
    run(cfg, out, engine=counting, progress=False)
    assert counting.problems == IDS[2:]
    assert counting.calls == 4 * 6 * 4
    assert [r["id"] for r in read_results(out)] == IDS
    check_complete(out)


def test_resume_after_kill_with_problems_in_flight(tmp_path):
    """Killed while four problems are in flight: the finished ones stay written, a rerun does the
    rest once each, and the results equal an uninterrupted run's."""
    cfg = make_config("run.concurrency=4")
    out = tmp_path / "run"
    killed = KilledEngine("bundled-5", at=7)
    with pytest.raises(Killed):
        run(cfg, out, engine=killed, progress=False)
    first = [r["id"] for r in read_results(out)]
    assert killed.problems[:4] == IDS[:4] and "bundled-5" in killed.problems  # several were in flight
    assert 0 < len(first) < len(IDS) and "bundled-5" not in first
    counting = FakeEngine()
    run(cfg, out, engine=counting, progress=False)
    assert sorted(counting.problems) == sorted(set(IDS) - set(first))  # nothing repeated
    check_complete(out)
    assert_as_uninterrupted(cfg, out, tmp_path / "whole")


def test_a_run_resumes_only_under_its_sampling_rule(tmp_path):
    """Each record names the rule its samples were decided by; a rerun under another rule would mix
    two samplers' trees in one run: refused in one line, nothing written."""
    out = tmp_path / "run"
    run(make_config("data.limit=2"), out, engine=FakeEngine(), progress=False)
    assert {r["rule"] for r in read_results(out)} == {"match_gumbel"}  # the default, at t = 0.6
    before = (out / "results.jsonl").read_text()
    refused = r"\(verify.rule=match_gumbel there, match_multinomial here; .*\(verify.rule=match_gumbel\)"
    with pytest.raises(ConfigError, match=refused):
        run(make_config("data.limit=3", "verify.rule=match_multinomial"), out, engine=FakeEngine(), progress=False)
    assert (out / "results.jsonl").read_text() == before
    counting = FakeEngine()
    run(make_config("data.limit=3"), out, engine=counting, progress=False)  # the same rule resumes
    assert counting.problems == IDS[2:3]
    # At temperature 0 nothing is sampled: any rule resumes a greedy run.
    greedy = tmp_path / "greedy"
    run(
        make_config("data.limit=1", "gen.temperature=0", "gen.eval_temperature=0"),
        greedy,
        engine=FakeEngine(),
        progress=False,
    )
    run(
        make_config("data.limit=2", "gen.temperature=0", "gen.eval_temperature=0", "verify.rule=rejection"),
        greedy,
        engine=FakeEngine(),
        progress=False,
    )
    assert {r["rule"] for r in read_results(greedy)} == {"greedy"}


@pytest.mark.parametrize("decoder", ["hf", "ar", "seed_stand"])
def test_every_decoder_reads_the_sampling_rule(decoder):
    """`hf` and `ar` draft nothing, yet their samples follow verify.rule like every other decoder's."""
    assert make_config(f"decoder={decoder}").decoder.verify.rule == "match_gumbel"
    assert make_config(f"decoder={decoder}", "verify.rule=match_multinomial").decoder.verify.rule == "match_multinomial"


def test_resume_drops_truncated_line(tmp_path):
    cfg = make_config("run.concurrency=1")  # problems one by one: results in order
    out = tmp_path / "run"
    run(cfg, out, engine=FakeEngine(), progress=False)
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    # Killed while writing problem 5's line: half of it on disk, no newline, problem 6 never started.
    (out / "results.jsonl").write_text("".join(lines[:4]) + lines[4][: len(lines[4]) // 2])

    counting = FakeEngine()
    summary = run(cfg, out, engine=counting, progress=False)
    assert counting.problems == ["bundled-5", "bundled-6"]
    assert [r["id"] for r in read_results(out)] == IDS
    assert check_complete(out) == json.loads(json.dumps(summary))


def test_resume_with_truncated_line_then_kill_again(tmp_path):
    # The cut line must be gone before new lines are appended, or a new record would be glued to it.
    cfg = make_config("run.concurrency=1")  # problems one by one: results in order
    out = tmp_path / "run"
    with pytest.raises(Killed):
        run(cfg, out, engine=KilledEngine("bundled-4", at=1), progress=False)
    with (out / "results.jsonl").open("a") as f:
        f.write('{"id": "bundled-4", "question": "A')
    with pytest.raises(Killed):
        run(cfg, out, engine=KilledEngine("bundled-6", at=8), progress=False)
    assert [r["id"] for r in read_results(out)] == IDS[:5]
    counting = FakeEngine()
    run(cfg, out, engine=counting, progress=False)
    assert counting.problems == ["bundled-6"]
    check_complete(out)


def test_summary_covers_every_problem_of_the_folder(tmp_path):
    # A rerun over a smaller selection summarises what the folder holds, not what it selected (issue 60).
    run(make_config("data.limit=3"), tmp_path, engine=FakeEngine(), progress=False)
    counting = FakeEngine()
    summary = run(make_config("data.limit=2", "data.offset=1"), tmp_path, engine=counting, progress=False)
    assert counting.calls == 0
    assert summary["n_problems"] == 3
    assert summary["accuracy"] == pytest.approx(1 / 3)  # bundled-1, outside this selection, is the one right


@pytest.mark.parametrize(
    "override, named",
    [
        ("search.n_thoughts=0", "search.n_thoughts=0"),
        ("search.breadth=0", "search.breadth=0"),
        ("search.breadth=-1", "search.breadth=-1"),
        ("task.depth=0", "task.depth=0"),
        ("gen.max_thought_tokens=0", "gen.max_thought_tokens=0"),
        ("gen.max_eval_tokens=-1", "gen.max_eval_tokens=-1"),
        ("gen.temperature=-0.5", "gen.temperature=-0.5"),
        ("gen.eval_temperature=-1", "gen.eval_temperature=-1"),
        ("gen.top_p=1.5", "gen.top_p=1.5"),
        ("gen.top_p=0", "gen.top_p=0"),
        ("gen.top_k=-2", "gen.top_k=-2"),
        ("gen.temperature=1e-30", "gen.temperature=1e-30 is too small to sample with"),
        ("gen.eval_temperature=nan", "gen.eval_temperature=nan"),
        ("search.n_thoughts=2.5", "search.n_thoughts=2.5"),
        ("gen.temperature=hot", "gen.temperature='hot'"),
        ("gen.seed=abc", "gen.seed='abc'"),
    ],
)
def test_config_errors(override, named):
    with pytest.raises(ConfigError) as info:
        make_config(override)
    assert named in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override, named", [("data.limit=0", "data.limit=0"), ("data.limit=-3", "data.limit=-3"), ("data.offset=-1", "")]
)
def test_data_errors(override, named):
    with pytest.raises(DataError, match=named or "data.offset=-1"):
        make_config(override)


def test_each_task_runs_its_own_default_search_and_the_bench_compares_decoders_on_bfs():
    """GSM8K's yaml names its search (early-stopping self-consistency over mixed solutions, at t = 0.5);
    the other tasks keep ToT-BFS at the config's t = 0.7; what the command line names wins; `tot.bench`
    builds BFS trees at 0.7 whatever the task."""
    from tot.search.best_of_n import BestOfNSettings

    def composed(name: str, *overrides: str):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            return compose(config_name=name, overrides=list(overrides))

    gsm8k = RunConfig.from_omegaconf(composed("solve"))
    assert gsm8k.search == "best_of_n" and gsm8k.gen.temperature == 0.5
    assert gsm8k.search_settings == BestOfNSettings(n=6, wave=2, stop="agree")
    assert RunConfig.from_omegaconf(composed("config", "search=bfs")).search_settings == BFSSettings()
    assert RunConfig.from_omegaconf(composed("config", "search.n=4")).search_settings.n == 4
    assert RunConfig.from_omegaconf(composed("config", "gen.temperature=0.7")).gen.temperature == 0.7
    for task in ("blocksworld", "creative_writing"):
        other = composed("solve", f"task={task}")
        assert other.search.name == "bfs" and other.gen.temperature == 0.7
    bench = composed("bench")
    assert bench.task.name == "gsm8k" and bench.search.name == "bfs" and bench.gen.temperature == 0.7
    assert (gsm8k.concurrency, bench.run.concurrency) == (16, 4)  # tot.solve's own: more rows a forward


def test_config_accepts_edges():
    cfg = make_config("search.n_thoughts=1", "search.breadth=1", "task.depth=1", "gen.temperature=0", "gen.top_p=1")
    assert cfg.search_settings.n_thoughts == cfg.search_settings.breadth == cfg.depth == 1
    assert cfg.gen.temperature == cfg.gen.eval_temperature == 0.0
    cfg = make_config("search.n_thoughts=5", "search.breadth=5", "data.limit=1", "data.offset=2")
    assert (cfg.data.limit, cfg.data.offset) == (1, 2)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["decoder=sd"], "decoder=sd drafts with a draft model: set draft.path="),
        (
            ["decoder=sd", "draft.path=self", "draft_tree.multi_candidate=false"],
            "draft_tree.k_config=[2, 2, 1] drafts several",
        ),
        (
            ["decoder=sd", "draft.path=self", "draft_tree.k_config=[2,0]"],
            "draft_tree.k_config=[2, 0] must list positive",
        ),
        (
            ["decoder=sd", "draft.path=self", "draft_tree.without_replacement=maybe"],
            "draft_tree.without_replacement='maybe'",
        ),
        (["decoder=sd", "draft.path=self", "draft.device=tpu"], "draft.device='tpu'"),
    ],
)
def test_decoder_config_errors(overrides, named):
    with pytest.raises((ConfigError, BackendError), match=re.escape(named)):
        make_config(*overrides)


def test_decoder_config():
    cfg = make_config(
        "decoder=sd", "draft.path=self", "draft_tree.k_config=[1,1,1]", "draft_tree.multi_candidate=false"
    )
    assert cfg.decoder.name == "sd" and cfg.decoder.draft_tree.k_config == (1, 1, 1)
    assert cfg.decoder.draft is not None and cfg.decoder.draft.path == "self"
    assert make_config("decoder=ar", "draft.path=self").decoder.draft is None  # ar drafts nothing
    # seed_stand (the default) drafts with a model too when one is configured.
    assert make_config("draft.path=self").decoder.draft is not None
    assert make_config().decoder.draft is None


def test_shards_split_the_selection_round_robin(tmp_path):
    shards = [make_config("data.limit=5", f"data.shard={i}", "data.num_shards=2").data for i in range(2)]
    from tasks import make_task

    task = make_task("gsm8k", 4)
    ids = [[p.id for p in task.load(s)] for s in shards]
    assert ids == [["bundled-1", "bundled-3", "bundled-5"], ["bundled-2", "bundled-4"]]
    with pytest.raises(DataError, match=r"data\.shard=2 data\.num_shards=2"):
        make_config("data.shard=2", "data.num_shards=2")


def test_collect_sweep_and_shards(tmp_path, capsys):
    from tot.collect import main as collect_main

    for i in range(2):
        cfg = make_config("data.limit=4", f"data.shard={i}", "data.num_shards=2")
        run(cfg, tmp_path / f"shard{i}", engine=FakeEngine(), progress=False)
    assert collect_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| shard") == 2
    combined = json.loads((tmp_path / "collected.json").read_text())["combined"]
    assert len(combined) == 1 and combined[0]["n_problems"] == 4
    assert combined[0]["accuracy"] == pytest.approx(1 / 4)  # bundled-1 is the one answered 12 of the four
    assert collect_main([str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize(
    "search", [["search=best_of_n", "search.aggregate=weighted"], ["search=mcts", "search.iterations=5"]]
)
def test_new_searches_resume_after_kill(search, tmp_path):
    """best_of_n and mcts killed with problems in flight: a rerun finishes the rest once each, and
    results and trees equal an uninterrupted run's."""
    cfg = make_config("run.concurrency=3", "task.depth=2", *search)
    out = tmp_path / "run"
    with pytest.raises(Killed):
        run(cfg, out, engine=KilledEngine("bundled-4", at=3), progress=False)
    first = [r["id"] for r in read_results(out)]
    assert 0 < len(first) < len(IDS) and "bundled-4" not in first
    counting = FakeEngine()
    run(cfg, out, engine=counting, progress=False)
    assert sorted(counting.problems) == sorted(set(IDS) - set(first))
    assert_as_uninterrupted(cfg, out, tmp_path / "whole")
