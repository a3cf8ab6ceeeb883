"""`python -m decoding.generate`: same greedy outputs from every decoder, resume, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import once_per_run
from hydra import compose, initialize_config_module
from test_cli import REPO, save_tiny_checkpoint, subprocess_env

from decoding.api.engine import Engine
from decoding.base.errors import ConfigError
from decoding.generate import GenerateConfig, generate

PROMPTS = [
    {"id": "a", "prompt": "the cat"},
    {"id": "b", "prompt": "hello world and more", "n": 3},
    {"id": 7, "prompt": "once upon a time"},
]


def write_prompts(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(prompts: Path, out: Path, *overrides: str) -> GenerateConfig:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(
            config_name="generate",
            overrides=[f"prompts={prompts}", f"out={out}", "gen.max_new_tokens=12", "batch_size=2", *overrides],
        )
    return GenerateConfig.from_omegaconf(cfg)


def read(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def engine_for(cfg: GenerateConfig, loaded) -> Engine:
    return Engine(loaded, cfg.decoder, loaded if cfg.decoder.draft else None)


def test_every_decoder_gives_the_same_greedy_completions(tmp_path, loaded):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    outputs = {}
    for decoder in ("hf", "ar", "sd"):
        # Whole trees (the fixed plan): the goodput plan rightly drafts little with the target as its draft.
        extra = ["draft.path=self", "draft_tree.k_config=[2,2,1]", "verify.plan=fixed"] if decoder == "sd" else []
        cfg = config(prompts, tmp_path / f"{decoder}.jsonl", f"decoder={decoder}", *extra)
        summary = generate(cfg, engine_for(cfg, loaded), progress=False)
        rows = read(cfg.out)
        assert [(r["id"], r["sample"]) for r in rows] == [("a", 0), ("b", 0), ("b", 1), ("b", 2), ("7", 0)]
        assert summary["completions"] == 5 and summary["decoder"] == decoder
        assert summary["generated_tokens"] == sum(len(r["token_ids"]) for r in rows)
        on_disk = json.loads(cfg.out.with_name(cfg.out.name + ".summary.json").read_text())
        assert on_disk["acceptance_length"] == summary["acceptance_length"]
        assert {"text", "token_ids", "finish_reason", "stats"} <= set(rows[0])
        outputs[decoder] = [r["token_ids"] for r in rows]
    assert outputs["hf"] == outputs["ar"] == outputs["sd"]
    assert summary["acceptance_length"] > 2.0  # sd drafting with the target itself


def test_sampled_completions_are_seeded(tmp_path, loaded):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[1:2])
    runs = []
    for name in ("x", "y"):
        cfg = config(prompts, tmp_path / f"{name}.jsonl", "gen.temperature=1.0", "gen.seed=3")
        generate(cfg, engine_for(cfg, loaded), progress=False)
        runs.append([r["token_ids"] for r in read(cfg.out)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 3  # the n samples of one prompt differ


def test_logprobs_and_choices_in_the_output(tmp_path, loaded):
    """gen.logprobs / gen.top_logprobs write each token's log-probability and its alternatives; a row
    with "choices" gets each answer's log-probability instead of a completion."""
    rows = [*PROMPTS[:1], {"id": "c", "prompt": "1 2 3 4", "choices": [" 5", " 56"]}]
    prompts = write_prompts(tmp_path / "p.jsonl", rows)
    cfg = config(prompts, tmp_path / "out.jsonl", "gen.logprobs=true", "gen.top_logprobs=2")
    generate(cfg, engine_for(cfg, loaded), progress=False)
    first, choice = read(cfg.out)
    assert [t["token"] for t in first["logprobs"]] == first["token_ids"]
    assert all(len(t["top"]) == 2 and t["top"][0][1] >= t["top"][1][1] for t in first["logprobs"])
    assert first["logprobs"][0]["top"][0][0] == first["token_ids"][0]  # greedy: the most likely token
    assert choice["token_ids"] == [] and set(choice["choice_logprobs"]) == {" 5", " 56"}
    assert choice["choice_logprobs"][" 5"] >= choice["choice_logprobs"][" 56"]
    with pytest.raises(ConfigError, match=r"gen.top_logprobs=2 must be in 0\.\.20, with gen.logprobs=true"):
        config(prompts, tmp_path / "x.jsonl", "gen.top_logprobs=2")


def test_rerun_resumes(tmp_path, loaded):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    cfg = config(prompts, tmp_path / "out.jsonl")
    generate(cfg, engine_for(cfg, loaded), progress=False)
    full = read(cfg.out)
    # A kill during the second batch: only prompt "a" and part of "b" reached the file, the last line cut.
    lines = cfg.out.read_text().splitlines(keepends=True)
    cfg.out.write_text("".join(lines[:2]) + lines[2][:10])
    summary = generate(cfg, engine_for(cfg, loaded), progress=False)
    assert summary["skipped_done"] == 1 and summary["prompts"] == 2 and summary["completions"] == 4
    # Nothing lost, nothing repeated: "b" was completed again from scratch, with the same seeds.
    assert read(cfg.out) == full


# --- the command line --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, tiny_model, tokenizer):
    """The folder and each case's completed command; once per test run."""
    return once_per_run(tmp_path_factory, "generate", lambda root: run_cli_cases(root, tiny_model, tokenizer))


def run_cli_cases(root: Path, tiny_model, tokenizer) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    ckpt = save_tiny_checkpoint(root / "tiny", tiny_model, tokenizer)
    prompts = write_prompts(root / "p.jsonl", PROMPTS)
    bad_json = root / "bad.jsonl"
    bad_json.write_text('{"id": 1, "prompt": "x"}\n{"id": 2, "prompt": }\n')
    no_prompt = write_prompts(root / "np.jsonl", [{"id": 1, "text": "x"}])
    base = [f"model.path={ckpt}", "gen.max_new_tokens=8"]
    cases = {
        "ar": [f"prompts={prompts}", f"out={root / 'ar.jsonl'}", *base],
        "sd": [f"prompts={prompts}", f"out={root / 'sd.jsonl'}", "decoder=sd", "draft.path=self", *base],
        "missing_out": [f"prompts={prompts}", *base],
        "missing_file": [f"prompts={root / 'nope.jsonl'}", f"out={root / 'o.jsonl'}", *base],
        "bad_json": [f"prompts={bad_json}", f"out={root / 'o.jsonl'}", *base],
        "no_prompt": [f"prompts={no_prompt}", f"out={root / 'o.jsonl'}", *base],
        "sd_no_draft": [f"prompts={prompts}", f"out={root / 'o.jsonl'}", "decoder=sd", *base],
        "single_candidate_tree": [
            f"prompts={prompts}",
            f"out={root / 'o.jsonl'}",
            "decoder=sd",
            "draft.path=self",
            "draft_tree.multi_candidate=false",
            *base,
        ],
        "unknown_key": [f"prompts={prompts}", f"out={root / 'o.jsonl'}", "gen.temprature=1", *base],
    }

    def run(args: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "decoding.generate", *args]
        return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(cases, pool.map(run, cases.values())))
    return root, done


def test_cli_outputs_agree(cli_runs):
    root, done = cli_runs
    for name in ("ar", "sd"):
        assert done[name].returncode == 0, done[name].stderr[-2000:]
        assert f"decoder={name}: 5 completions" in done[name].stdout
    ar = [r["token_ids"] for r in read(root / "ar.jsonl")]
    sd = [r["token_ids"] for r in read(root / "sd.jsonl")]
    assert ar == sd


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing_out", "out is required: python -m decoding.generate prompts=PATH out=PATH"),
        ("missing_file", "nope.jsonl does not exist"),
        ("bad_json", "bad.jsonl:2 is not valid JSON"),
        ("no_prompt", 'np.jsonl:1 needs an "id" and a non-empty "prompt" string'),
        ("sd_no_draft", "decoder=sd drafts with a draft model: set draft.path="),
        ("single_candidate_tree", "draft_tree.k_config=[2, 2, 1] drafts several candidates per position"),
        ("unknown_key", "gen.temprature is not a config key"),
    ],
)
def test_cli_bad_input(cli_runs, case, expected):
    _, done = cli_runs
    proc = done[case]
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr


@pytest.mark.parametrize(
    "override, named",
    [
        ("gen.temperature=1e-30", "gen.temperature=1e-30 is too small to sample with"),
        ("gen.temperature=nan", "gen.temperature=nan"),
        ("gen.top_p=0", "gen.top_p=0.0 must be in (0, 1]"),
        ("gen.top_k=-1", "gen.top_k=-1 must be >= 0"),
        ("gen.max_new_tokens=0", "gen.max_new_tokens=0 must be >= 1"),
    ],
)
def test_sampling_settings_are_checked_at_load_by_the_requests_rules(tmp_path, override, named):
    from decoding.base.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        config(tmp_path / "p.jsonl", tmp_path / "o.jsonl", override)
    assert str(info.value).startswith(named) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("temperatures", (0.5, float("nan")), "temperatures[1]=nan must be a finite number"),
        ("temperatures", (1e-9,), "temperatures[0]=1e-09 is too small to sample with"),
        ("top_p", 0.0, "top_p=0.0 must be in (0, 1]"),
        ("top_k", -1, "top_k=-1 must be >= 0"),
    ],
)
def test_the_sampler_cost_command_checks_its_settings_by_the_requests_rules(field, value, named):
    from decoding.base.errors import ConfigError
    from decoding.runtime.spec import ModelSpec
    from decoding.sampler_cost import SamplerCostConfig

    settings = {"model": ModelSpec(), "prompt": "x", "temperatures": (0.6,), "top_k": 0, "top_p": 1.0, "repeats": 1}
    with pytest.raises(ConfigError) as info:
        SamplerCostConfig(**{**settings, field: value})
    assert str(info.value).startswith(named) and "\n" not in str(info.value)
