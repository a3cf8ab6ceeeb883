"""Runs spread over a cluster with Hydra's launchers: a sweep over data shards with submitit (its local
executor, what SLURM runs) and with Ray (a local cluster), collected by `tot.collect`, gives the
single-process run's results and trees; under every launcher shipped, a member refused by its folder
leaves that folder as it was while the others run; the shipped cluster presets compose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_model
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from decoding.base.cli import check_overrides
from tot.collect import collect
from tot.runs.config import RunConfig
from tot.runs.run import run

REPO = Path(__file__).resolve().parents[1]
RAY_REMOTE = {"num_gpus": 1, "num_cpus": 4}
SMALL = ["data.limit=5", "task.depth=2", "search=bfs", "search.n_thoughts=2"]
SMALL += ["gen.max_thought_tokens=8", "gen.max_eval_tokens=4"]
# The launchers shipped (hydra/launcher=...), each with the plugin it needs and the extra that installs it.
SHIPPED = {
    "basic": None,
    "joblib": ("hydra_plugins.hydra_joblib_launcher", "the sweeps extra"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "the slurm extra"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "the ray extra"),
}


@pytest.fixture(scope="module")
def options(tmp_path_factory, tokenizer) -> list[str]:
    """A run's options, on a tiny checkpoint on disk."""
    root = tmp_path_factory.mktemp("tiny")
    model = build_model(len(tokenizer), max_positions=4096)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return [f"model.path={root}", "decoder=ar", "gen.temperature=0.8", *SMALL]


@pytest.fixture(scope="module")
def single(tmp_path_factory, options) -> tuple[list[str], Path]:
    """The run's options and its single-process run directory."""
    folder = tmp_path_factory.mktemp("launchers") / "single"
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = RunConfig.from_omegaconf(compose(config_name="config", overrides=options))
    run(cfg, folder, progress=False)
    return options, folder


def made_by_a_run(folder: Path, options: list[str]) -> dict[str, bytes]:
    """`folder` as a command-line run under `options` leaves it (results, configuration.json, Hydra's
    .hydra/config.yaml, its log), and every file's bytes."""
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=options)
    run(RunConfig.from_omegaconf(cfg), folder, progress=False)
    (folder / ".hydra").mkdir()
    OmegaConf.save(cfg, folder / ".hydra" / "config.yaml")
    (folder / "solve.log").write_text("[2026-11-30 10:00:00,000][tot.runs.run][INFO] - a line of that run\n")
    return contents(folder)


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/" for p in folder.rglob("*")}


def sweep(cwd: Path, launcher: str, options: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tot.solve", "-m", f"hydra/launcher={launcher}", "data.shard=0,1"]
    cmd += ["model=smollm2-135m", "data.num_shards=2", *options, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def records(folder: Path) -> dict[str, dict]:
    out = {}
    for path in folder.rglob("results.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[r["id"]] = {k: r[k] for k in ("answer", "correct", "tokens")}
    return out


def trees(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.rglob("trees/*.json")}


def check_collected(sweep_dir: Path, single_dir: Path) -> None:
    shards = [p.parent for p in sweep_dir.rglob("summary.json")]
    assert len(shards) == 2
    assert records(sweep_dir) == records(single_dir) and len(records(single_dir)) == 5
    assert trees(sweep_dir) == trees(single_dir)
    (row,) = collect(sweep_dir)[1]  # one configuration: the shards combined
    whole = json.loads((single_dir / "summary.json").read_text())
    assert (row["n_problems"], row["generated_tokens"]) == (whole["n_problems"], whole["generated_tokens"])
    assert row["accuracy"] == whole["accuracy"]


def test_sharded_sweep_with_submitit_equals_one_process(single, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra")
    options, single_dir = single
    proc = sweep(REPO, "submitit_local", options, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_collected(tmp_path / "sweep", single_dir)


def test_sharded_sweep_on_a_local_ray_cluster_equals_one_process(single, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="the ray extra")
    options, single_dir = single
    # Run from an empty folder with the default (relative) sweep directory: the jobs write where
    # the command was started, not in Ray's worker folders.
    proc = sweep(tmp_path, "ray", options, "+hydra.launcher.ray.init.include_dashboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    check_collected(sweep_dir, single_dir)


@pytest.mark.parametrize("launcher", SHIPPED)
def test_a_member_refused_by_its_folder_is_left_as_it_was(launcher, options, tmp_path):
    """A sweep over two shards where shard 1's folder holds results made at another temperature: that
    folder is byte for byte as it was (Hydra's .hydra/config.yaml in it too), shard 0 runs, and the
    sweep ends with exit status 2 and one line naming the member refused."""
    if SHIPPED[launcher]:
        plugin, extra = SHIPPED[launcher]
        pytest.importorskip(plugin, reason=extra)
    refused = tmp_path / "sweep" / "1_gsm8k_ar"
    earlier = made_by_a_run(refused, [*options, "gen.temperature=0.7", "data.shard=1", "data.num_shards=2"])
    extra = ["+hydra.launcher.ray.init.include_dashboard=false"] if launcher == "ray" else []
    proc = sweep(REPO, launcher, options, f"hydra.sweep.dir={tmp_path / 'sweep'}", *extra)
    report = f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, report
    assert contents(refused) == earlier
    assert json.loads((tmp_path / "sweep" / "0_gsm8k_ar" / "summary.json").read_text())["n_problems"] == 3
    assert "Traceback" not in proc.stderr, report
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: sweep members refused")]
    assert "#1 (data.shard=1)" in line and "#0" not in line, report


@pytest.mark.parametrize(
    "preset, target, values",
    [
        ("slurm", "SlurmLauncher", {"gpus_per_node": 1, "timeout_min": 720}),
        (
            "ray_cluster",
            "RayLauncher",
            {"ray": {"init": {"address": "auto"}, "remote": {"num_gpus": 1, "num_cpus": 4}}},
        ),
    ],
)
def test_cluster_presets_compose(preset, target, values):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={preset}"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith(target)
    assert {k: launcher[k] for k in values} == values


def test_a_launcher_without_its_extra_is_one_line(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name: str, *args):
        if "ray_launcher" in name:  # as without any launcher: not even the hydra_plugins package
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as info:
        check_overrides(["hydra/launcher=ray_cluster"], "config", ("task",))
    assert info.value.code == 2
    assert "pip install 'tot-spec[ray]'" in capsys.readouterr().err
