"""`python -m tot.solve` on bad input: exit status 2 and one line naming the value, never a traceback.

Every case is a subprocess (a few seconds of imports each), so they all start together in one
module fixture and each test checks its own case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import once_per_run

from decoding.base.cli import check_overrides
from tot.solve import GROUPS

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 64  # the tiny checkpoint's context, far shorter than any GSM8K prompt


def solve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tot.solve", "model=smollm2-135m", *args]  # the embedded model, not the bare default


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def save_tiny_checkpoint(path: Path, model, tokenizer) -> Path:
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = CONTEXT
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cli_cases(tmp_path_factory, tiny_model, tokenizer):
    """name -> (expected text in the error line, completed process, run dir); once per test run."""
    return once_per_run(tmp_path_factory, "cli", lambda root: run_cli_cases(root, tiny_model, tokenizer))


def run_cli_cases(root: Path, tiny_model, tokenizer) -> dict[str, tuple[str, subprocess.CompletedProcess, Path]]:
    missing = root / "data" / "missing.jsonl"
    malformed = root / "malformed.jsonl"
    malformed.write_text(
        '{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "What is 2 + 2?", "answer": #### 4}\n'
    )
    tiny = save_tiny_checkpoint(root / "tiny-model", tiny_model, tokenizer)
    cases = {
        "task": (["task=nope"], "task=nope"),
        "sweep_choice": (["-m", "decoder=ar,nope"], "decoder=nope"),
        "unknown_key": (["gen.nope=1"], "gen.nope is not a config key"),
        "missing_data": ([f"data.path={missing}"], f"data.path={missing}"),
        "malformed_data": ([f"data.path={malformed}"], f"{malformed}:2"),
        "n_thoughts": (["search=bfs", "search.n_thoughts=0"], "search.n_thoughts=0"),
        "draft_vocab": (["decoder=sd", "draft.path=self", "draft.vocab=64"], "draft.vocab=64"),
        "model_path": (["model.path=/nonexistent/model/dir"], "model.path=/nonexistent/model/dir does not exist"),
        "context": ([f"model.path={tiny}", "data.limit=1"], f"exceeds the model's context of {CONTEXT} tokens"),
    }

    def launch(name: str) -> tuple[str, subprocess.CompletedProcess, Path]:
        args, expected = cases[name]
        run_dir = root / "runs" / name
        proc = subprocess.run(
            solve_cmd(*args, f"hydra.run.dir={run_dir}"),
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        return expected, proc, run_dir

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        done = dict(zip(cases, pool.map(launch, cases)))
    return done


CASE_NAMES = [
    "task",
    "sweep_choice",
    "unknown_key",
    "missing_data",
    "malformed_data",
    "n_thoughts",
    "draft_vocab",
    "model_path",
    "context",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_one_line_exit_2(cli_cases, name):
    expected, proc, run_dir = cli_cases[name]
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 2, report
    assert "Traceback" not in proc.stderr, report
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, report
    last = lines[-1]
    assert last.startswith("error: "), report
    assert expected in last, report
    assert sum(line.startswith("error:") for line in lines) == 1, report
    # Nothing was solved, so no results were written.
    results = run_dir / "results.jsonl"
    assert not results.exists() or results.read_text() == "", report


# The cases above run one command each (seconds of imports apiece); these take the same path as one of
# them (a group choice, a value RunConfig refuses: tests/test_run.py checks each such value in-process).
SAME_PATH = {"decoder=nope": "decoder=nope is unknown", "model=nope": "model=nope is unknown"}
SAME_PATH["search=nope"] = "search=nope is unknown"


@pytest.mark.parametrize("override", list(SAME_PATH))
def test_a_bad_group_choice_is_one_line_and_exit_2(override, capsys):
    with pytest.raises(SystemExit) as info:
        check_overrides([override], "config", GROUPS)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and SAME_PATH[override] in err and "\n" not in err


def test_every_case_is_checked(cli_cases):
    assert sorted(cli_cases) == sorted(CASE_NAMES)
