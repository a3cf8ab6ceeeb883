"""`python -m tot.bench` on a tiny model: every decoder on the same problems, the lossless check."""

from __future__ import annotations

import itertools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import DEVICE, build_model
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from test_cli import REPO, subprocess_env

from decoding.base.errors import ConfigError
from decoding.runtime.models import LoadedModel
from tot.bench import bench, decoder_configs, table
from tot.runs.config import RunConfig

SMALL = ["task.depth=1", "search.n_thoughts=2", "data.limit=1", "gen.max_thought_tokens=6", "gen.max_eval_tokens=4"]


@pytest.fixture(scope="module")
def long_context(tokenizer) -> LoadedModel:
    """A tiny model whose context holds a GSM8K prompt in the tiny byte-level tokenizer."""
    model = build_model(len(tokenizer), max_positions=4096)
    return LoadedModel(model, tokenizer, DEVICE, False, "tiny-long")


def compose_bench(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="bench", overrides=[*SMALL, *overrides])
    return RunConfig.from_omegaconf(cfg), OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize("temperature, lockstep", [(0.0, False), (0.8, True)])
def test_bench_every_decoder_lossless(long_context, temperature, lockstep):
    """Same trees as hf's at temperature 0, and sampled (the default matched rule), whether the
    entries run in turns or all at once, their forwards interleaved."""
    run_cfg, container = compose_bench(f"gen.temperature={temperature}")
    configs, skipped = decoder_configs(container, container["bench"]["decoders"], has_draft=False)
    assert skipped == ["sd", "seed"]  # no draft model configured
    result = bench(run_cfg, configs, long_context, None, progress=False, lockstep=lockstep)
    assert result["lossless_checked"] and result["mismatches"] == []
    rows = result["decoders"]
    assert {r["clock"] for r in rows.values()} == {"steps" if lockstep else "wall"}
    assert list(rows) == ["hf", "ar", "pld", "recycling", "stand", "seed_stand", "aded"]
    assert rows["hf"]["speedup_vs_hf"] == pytest.approx(1.0)
    assert all(r["tokens"] == rows["hf"]["tokens"] > 0 for r in rows.values())
    assert all(r["peak_kv_mb"] > 0 for n, r in rows.items() if n != "hf")
    assert result["process_peak_rss_mb"] > 100  # the process holds at least torch and a model
    text = table(result)
    assert text.count("\n") == 1 + len(rows) + 2 * lockstep and "`seed_stand`" in text


def test_bench_lockstep_interleaves_forwards(long_context, monkeypatch):
    """In lockstep the engines take turns forward by forward and each entry's time is its own
    engine's steps; in turns each entry runs its batch of problems through before the next."""
    from decoding.api.engine import Engine
    from decoding.schedules.scheduler import Scheduler

    run_cfg, container = compose_bench("gen.temperature=0", "bench.decoders=[ar,pld]", "data.limit=2")
    configs, _ = decoder_configs(container, ["ar", "pld"], has_draft=False)
    steps: list[str] = []
    original = Scheduler.step

    def logged(self):
        steps.append(self.name)
        return original(self)

    monkeypatch.setattr(Scheduler, "step", logged)
    timed: list[float] = []
    original_init = Engine.__init__

    def kept(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        timed.append(self)

    monkeypatch.setattr(Engine, "__init__", kept)
    result = bench(run_cfg, configs, long_context, None, progress=False, lockstep=True, concurrency={"ar": 2, "pld": 1})
    switches = sum(a != b for a, b in itertools.pairwise(steps))
    assert switches > len(steps) // 4, steps  # turns forward by forward, not entry after entry
    rows = result["decoders"]
    for engine, name in zip(timed, ["ar", "pld"]):
        assert rows[name]["clock"] == "steps" and 0 < rows[name]["time_s"] <= engine.step_s
    steps.clear()
    bench(run_cfg, configs, long_context, None, progress=False, concurrency={"ar": 2, "pld": 1})
    # In turns, after each engine's warm-up call: ar's batch of 2 problems, then pld's 2 one at a time.
    assert sum(a != b for a, b in itertools.pairwise(steps)) == 3, steps


def test_bench_reports_a_difference(long_context, monkeypatch):
    """The check can fail: a decoder whose output differs from hf's is named."""
    run_cfg, container = compose_bench("gen.temperature=0", "bench.decoders=[hf,ar]")
    configs, _ = decoder_configs(container, ["hf", "ar"], has_draft=False)
    from decoding.schedules.scheduler import Scheduler

    original = Scheduler.step

    def off_by_one(self):
        step = original(self)
        for s in step.finished:
            s.generated[-1] = (s.generated[-1] + 1) % 300
        return step

    monkeypatch.setattr(Scheduler, "step", off_by_one)
    result = bench(run_cfg, configs, long_context, None, progress=False)
    assert result["mismatches"] and result["mismatches"][0].startswith("ar on ")


def test_bench_rejects_unknown_decoder():
    _, container = compose_bench()
    with pytest.raises(ConfigError, match=r"bench\.decoders has 'nope'"):
        decoder_configs(container, ["hf", "nope"], has_draft=False)
    from tot.bench import lockstep_option

    assert lockstep_option(container) is None  # auto: decided by the loaded model's device
    _, forced = compose_bench("bench.lockstep=false")
    assert lockstep_option(forced) is False
    _, bad = compose_bench("bench.lockstep=sometimes")
    with pytest.raises(ConfigError, match=r"bench\.lockstep='sometimes' must be auto, true or false"):
        lockstep_option(bad)


def test_scaling_grid(long_context):
    from tot.scaling import scaling, scaling_table

    run_cfg, container = compose_bench()
    configs, _ = decoder_configs(container, ["ar", "stand"], has_draft=False)
    rows, mismatches = scaling(
        run_cfg, lambda cell: bench(cell, configs, long_context, None, progress=False), [1, 2], [0.0, 1.0]
    )
    assert [(r["temperature"], r["search"], r["budget"], r["decoder"]) for r in rows] == [
        (t, "bfs", n, d) for t in (0.0, 1.0) for n in (1, 2) for d in ("ar", "stand")
    ]
    assert mismatches == []  # no hf entry: stand's trees were compared with ar's
    assert all(r["acceptance_length"] >= 1.0 for r in rows)
    assert all(r["speedup_vs_ar"] == pytest.approx(1.0) for r in rows if r["decoder"] == "ar")
    assert scaling_table(rows).count("`stand`") == 4


def test_scaling_curve_across_searches(long_context, tmp_path):
    """Two searches swept over N with hf beside ar: every cell's trees checked, the curve drawn, and
    the row's cost grows with N."""
    from tot.scaling import plot_scaling, scaling

    run_cfg, container = compose_bench("gen.temperature=0.7")
    configs, _ = decoder_configs(container, ["hf", "ar"], has_draft=False)
    searches = {"bfs": None, "best_of_n": {"max_tokens": 8}}
    rows, mismatches = scaling(
        run_cfg, lambda cell: bench(cell, configs, long_context, None, progress=False), [1, 3], [0.7], searches
    )
    assert mismatches == []
    assert [(r["search"], r["budget"], r["decoder"]) for r in rows] == [
        (s, n, d) for s in ("bfs", "best_of_n") for n in (1, 3) for d in ("hf", "ar")
    ]
    for search in ("bfs", "best_of_n"):
        cost = {r["budget"]: r["tokens"] for r in rows if r["search"] == search and r["decoder"] == "ar"}
        assert cost[3] > cost[1]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    pytest.importorskip("matplotlib")
    assert plot_scaling(rows, tmp_path / "scaling.png") and (tmp_path / "scaling.png").stat().st_size > 0


def test_scaling_searches_are_checked():
    from tot.scaling import search_cells

    run_cfg, _ = compose_bench()
    assert list(search_cells(run_cfg, None)) == ["bfs"]
    cells = search_cells(run_cfg, {"mcts": {"iterations": 2}, "best_of_n": None})
    assert cells["mcts"].iterations == 2 and cells["best_of_n"].n == 8
    with pytest.raises(ConfigError, match=r"bench\.searches has 'beam'"):
        search_cells(run_cfg, {"beam": None})
    with pytest.raises(ConfigError, match=r"bench\.searches\.mcts\.depth is not an option"):
        search_cells(run_cfg, {"mcts": {"depth": 3}})


def test_bench_variants(long_context, tmp_path):
    """`bench.variants`: one decoder with other options under its own name, in the same run (lossless check too)."""
    from decoding.speculation.draft_tree import k_config_parents
    from decoding.trees.static import StaticTree

    tree = tmp_path / "chain.json"
    StaticTree(tuple(k_config_parents((1, 1, 1))), {}).save(tree)
    variants = (
        "bench.variants={stand_chain: {decoder: stand, stand.tree: '" + str(tree) + "'}, "
        "sd_pct: ['decoder=sd', 'draft_tree.tree_policy=pct', 'draft_tree.pct_ratio=0.2'], "
        "sd_wr: {decoder: sd, draft_tree.without_replacement: true}}"
    )
    run_cfg, container = compose_bench("gen.temperature=0", "bench.decoders=[hf,stand]", "draft.path=self", variants)
    configs, skipped = decoder_configs(container, ["hf", "stand"], False, container["bench"]["variants"])
    assert skipped == ["sd_pct", "sd_wr"]  # no draft model configured
    configs, skipped = decoder_configs(container, ["hf", "stand"], True, container["bench"]["variants"])
    assert list(configs) == ["hf", "stand", "stand_chain", "sd_pct", "sd_wr"] and not skipped
    assert (
        configs["stand_chain"].section("stand").tree == str(tree)
        and configs["stand"].section("stand").tree == "default"
    )
    assert configs["sd_pct"].draft_tree.tree_policy == "pct" and configs["sd_pct"].draft_tree.pct_ratio == 0.2
    assert configs["sd_wr"].draft_tree.without_replacement and configs["sd_wr"].name == "sd"
    result = bench(run_cfg, configs, long_context, long_context, progress=False)
    assert result["lossless_checked"] and result["mismatches"] == []
    assert list(result["decoders"]) == list(configs) and "`sd_pct`" in table(result)
    for overrides, message in (
        ({"draft_tree.tree_policy": "pct"}, r"bench\.variants\.v does not say which decoder"),
        ({"decoder": "sd", "gen.temperature": 1.0}, r"bench\.variants\.v sets gen\.temperature: every decoder"),
        ({"decoder": "sd", "sd.nope": 1}, r"bench\.variants\.v sets sd\.nope, which is not a config key"),
        (
            {"decoder": "sd", "draft_tree.tree_policy": "x"},
            r"bench\.variants\.v: draft_tree\.tree_policy=x is not one of",
        ),
        ("decoder=sd", r"bench\.variants\.v='decoder=sd' must be a list of overrides"),
        ({"decoder": "sd", "draft.path": "x"}, r"bench\.variants\.v sets draft\.path: every decoder"),
        ({"decoder": "sd", "draft.vocab": 8}, r"bench\.variants\.v: draft\.vocab=8: .*draft\.path=edd"),
    ):
        with pytest.raises(ConfigError, match=message):
            decoder_configs(container, [], True, {"v": overrides})
    # draft.vocab changes how a decoder uses the shared EDD, not the model: a variant may set it.
    _, edd = compose_bench("draft.path=edd", "bench.variants={sd_vocab: {decoder: sd, draft.vocab: 8}}")
    configs, _ = decoder_configs(edd, ["sd"], True, edd["bench"]["variants"])
    assert configs["sd"].draft.vocab is None and configs["sd_vocab"].draft.vocab == 8
    with pytest.raises(ConfigError, match=r"bench\.variants\.stand is also in bench\.decoders"):
        decoder_configs(container, ["stand"], True, {"stand": {"decoder": "stand"}})


def test_bench_evaluator_variants(long_context):
    """`task.evaluator` per entry: in-context entries are held to an `hf` entry under the same
    evaluator, and the table reports prompt tokens per phase."""
    from tot.bench import evaluators

    variants = (
        "bench.variants={hf_ic: {decoder: hf, task.evaluator: in_context}, "
        "ar_ic: {decoder: ar, task.evaluator: in_context}}"
    )
    run_cfg, container = compose_bench("gen.temperature=0", "task.value=sampled", "bench.decoders=[hf,ar]", variants)
    configs, _ = decoder_configs(container, ["hf", "ar"], False, container["bench"]["variants"])
    names = list(configs)
    result = bench(run_cfg, configs, long_context, None, progress=False, evaluator=evaluators(container, names))
    assert result["lossless_checked"] and result["mismatches"] == []
    rows = result["decoders"]
    assert [rows[n]["evaluator"] for n in names] == ["separate", "separate", "in_context", "in_context"]
    assert (
        rows["ar_ic"]["phases"]["evaluate"]["prompt_tokens_computed"]
        < rows["ar"]["phases"]["evaluate"]["prompt_tokens_computed"]
    )
    assert "`ar_ic` (in_context)" in table(result)
    # Ratios are taken against the baseline under the entry's own evaluator.
    assert rows["hf_ic"]["speedup_vs_hf"] == pytest.approx(1.0)
    assert rows["ar_ic"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert rows["ar_ic"]["speedup_vs_hf"] == pytest.approx(
        rows["ar_ic"]["tokens_per_s"] / rows["hf_ic"]["tokens_per_s"]
    )


def test_turns_alternate_entries_of_one_concurrency():
    """Entries take turns one batch of their own concurrency at a time, in turn and then in reverse
    turn: entries at one problem alternate per problem, and each entry runs every problem once."""
    from tasks.base import Problem
    from tot.bench import turn_order

    problems = [Problem(id=str(i), question=f"q{i}", gold="0") for i in range(4)]
    plan = turn_order(["ar", "ar_c1", "pld_c1"], problems, {"ar": 4, "ar_c1": 1, "pld_c1": 1})
    assert [(n, [p.id for p in c]) for n, c in plan] == [
        ("ar", ["0", "1", "2", "3"]),
        ("ar_c1", ["0"]),
        ("pld_c1", ["0"]),
        ("pld_c1", ["1"]),
        ("ar_c1", ["1"]),
        ("ar_c1", ["2"]),
        ("pld_c1", ["2"]),
        ("pld_c1", ["3"]),
        ("ar_c1", ["3"]),
    ]
    # The mean place of two entries at one concurrency is the same: linear drift slows them alike.
    places = {n: [i for i, (m, _) in enumerate(plan) if m == n] for n in ("ar_c1", "pld_c1")}
    assert sum(places["ar_c1"]) == sum(places["pld_c1"])
    assert turn_order(["a"], problems[:3], {"a": 2})[1][1] == problems[2:3]


NOTHING_TO_RUN = {
    "empty": ("bench.decoders=[]", "bench.decoders=[] leaves nothing to run; name decoders to compare"),
    "draft": ("bench.decoders=[sd]", "bench.decoders=['sd'] leaves nothing to run; sd needs a draft model"),
    "string": ("bench.decoders=ar", "bench.decoders='ar' must be a list such as [ar,seed_stand]"),
}


def test_a_bench_with_nothing_to_run_is_one_line_and_writes_nothing(tmp_path):
    """Refused before the model loads: a table of no rows would say that every decoder was checked."""

    def launch(case: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "tot.bench", NOTHING_TO_RUN[case][0], f"hydra.run.dir={tmp_path / case}"]
        return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(len(NOTHING_TO_RUN)) as pool:
        procs = dict(zip(NOTHING_TO_RUN, pool.map(launch, NOTHING_TO_RUN)))
    for case, proc in procs.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (case, proc.stderr[-3000:])
        assert lines[-1].startswith("error: " + NOTHING_TO_RUN[case][1]), (case, lines[-1])
        assert "loaded" not in proc.stderr and not (tmp_path / case / "bench.json").exists()


def test_a_rollout_valued_mcts_builds_hfs_trees_under_every_decoder_and_concurrency(long_context):
    """task.value=rollout under MCTS, sampled: every decoder's trees, at one problem in flight and at
    four, are hf's (the completions, their groups and the values read from them included)."""
    rollout = ["search=mcts", "task.value=rollout", "task.depth=2", "task.rollouts=2", "task.rollout_tokens=6"]
    variants = "bench.variants={ar_1: {decoder: ar, run.concurrency: 1}}"
    run_cfg, container = compose_bench(
        *rollout, "search.iterations=2", "search.parallel=2", "data.limit=2", "gen.temperature=0.8", variants
    )
    configs, _ = decoder_configs(container, ["hf", "ar", "seed_stand"], False, container["bench"]["variants"])
    result = bench(run_cfg, configs, long_context, None, progress=False)
    assert result["lossless_checked"] and result["mismatches"] == []
    assert list(result["decoders"]) == ["hf", "ar", "seed_stand", "ar_1"]
    assert {r["tokens"] for r in result["decoders"].values()} == {result["decoders"]["hf"]["tokens"]}
