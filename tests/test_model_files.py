"""Broken model files (issue 28): a GGUF cut short or foreign, a checkpoint folder with a weight file
cut short or missing, a conversion killed halfway. Each is one line naming the file and what is
wrong (a cut file: its size against the size its header promises), exit 2, no traceback; a broken
conversion is never loaded."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_cli import REPO, save_tiny_checkpoint, solve_cmd, subprocess_env
from test_gguf_load import QWEN2, odd_gguf, write_gguf

from decoding.base.errors import BackendError
from decoding.runtime.model_files import check_checkpoint, check_gguf, gguf_size
from decoding.runtime.models import embedded_file

CUT = 30 * 2**20  # a download stopped at 30 MB


@pytest.fixture(scope="module")
def gguf() -> Path:
    return embedded_file("smollm2-135m")


def cut_copy(src: Path, dst: Path, size: int) -> Path:
    with src.open("rb") as f:
        dst.write_bytes(f.read(size))
    return dst


def test_a_whole_gguf_promises_its_own_size(gguf):
    assert gguf_size(gguf) == gguf.stat().st_size
    check_gguf(gguf)


def test_gguf_faults(gguf, tmp_path):
    size = gguf.stat().st_size
    cut = cut_copy(gguf, tmp_path / "cut.gguf", CUT)
    with pytest.raises(BackendError, match=rf"cut\.gguf is cut short: {CUT} bytes where its header promises {size};"):
        check_gguf(cut)
    head = cut_copy(gguf, tmp_path / "head.gguf", 4096)  # inside the vocabulary
    with pytest.raises(BackendError, match=r"head\.gguf is cut short inside its header \(4096 bytes\)"):
        check_gguf(head)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_text("<html>404 Not Found</html>")
    with pytest.raises(BackendError, match=r"foreign\.gguf is not a GGUF file \(it starts with b'<htm'"):
        check_gguf(foreign)


def test_checkpoint_faults(tiny_model, tokenizer, tmp_path):
    folder = save_tiny_checkpoint(tmp_path / "tiny", tiny_model, tokenizer)
    check_checkpoint(folder, "model")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    cut_copy(weights, tmp_path / "w", size // 2)
    (tmp_path / "w").replace(weights)
    with pytest.raises(BackendError, match=rf"model\.safetensors is cut short: {size // 2} bytes .* promises {size};"):
        check_checkpoint(folder, "model")
    weights.unlink()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(BackendError, match=r"is missing model-00001-of-00002.safetensors, model-00002-of-00002"):
        check_checkpoint(folder, "model")


def test_broken_model_files_through_the_cli(gguf, tiny_model, tokenizer, tmp_path):
    cut = cut_copy(gguf, tmp_path / "cut.gguf", CUT)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04 a zip file, not a model")
    folder = save_tiny_checkpoint(tmp_path / "tiny", tiny_model, tokenizer)
    weights = folder / "model.safetensors"
    full = weights.stat().st_size
    os.truncate(weights, full - 1000)
    cases = {
        cut: f"model.path={cut} is cut short: {CUT} bytes where its header promises {gguf.stat().st_size}",
        foreign: f"model.path={foreign} is not a GGUF file (it starts with b'PK\\x03\\x04'",
        folder: f"{weights} is cut short: {full - 1000} bytes where its header promises {full}",
    }

    def launch(path: Path) -> subprocess.CompletedProcess:
        cmd = solve_cmd(f"model.path={path}", "data.limit=1", f"hydra.run.dir={tmp_path / 'runs' / path.name}")
        return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=3) as pool:
        procs = dict(zip(cases, pool.map(launch, cases)))
    for path, expected in cases.items():
        proc = procs[path]
        report = f"{path}: exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, report
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], report


def error_lines(tmp_path: Path, cases: dict[str, list[str]], env: dict[str, dict[str, str]] | None = None) -> dict:
    """tot.solve on one problem per case (its overrides, its extra environment), two at a time: each
    case's one error line, after checking exit status 2 and no traceback."""

    def launch(case: str) -> subprocess.CompletedProcess:
        cmd = solve_cmd("data.limit=1", *cases[case], f"hydra.run.dir={tmp_path / 'runs' / case}")
        more = (env or {}).get(case, {})
        return subprocess.run(
            cmd, cwd=REPO, env={**subprocess_env(), **more}, capture_output=True, text=True, timeout=300
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(zip(cases, pool.map(launch, cases)))
    lines = {}
    for case, proc in procs.items():
        report = f"{case}: exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, report
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, report
        lines[case] = errors[0]
    return lines


def test_a_cache_folder_that_is_a_file_through_the_cli(tmp_path):
    """TOT_CACHE_DIR or model.cache_dir naming a file: one line naming the folder and both keys."""
    file = tmp_path / "a_file"
    file.write_text("not a folder")
    lines = error_lines(
        tmp_path, {"env": [], "key": [f"model.cache_dir={file}"]}, {"env": {"TOT_CACHE_DIR": str(file)}}
    )
    for line in lines.values():
        assert f"into {file}/" in line and f"({file} is a file, not a folder)" in line, line
        assert "set model.cache_dir (or TOT_CACHE_DIR) to a writable folder" in line, line


def test_a_damaged_digest_memo_is_hashed_again(gguf, tmp_path):
    """The memo of a file's digest cut or overwritten, or well-formed but wrong: the file is hashed again
    (its record found as before, so model.activations=auto keeps int8), and the memo rewritten."""
    from decoding.runtime import numerics

    record = numerics.read(tmp_path, gguf)
    assert record is not None  # the embedded model's shipped record
    (memo,) = (tmp_path / "digests").iterdir()
    true = memo.read_text()
    for damage in ("", "0123abc", "\udcff", "z" * 64, "0" * 64):  # the last well-formed, but no record's
        memo.write_bytes(damage.encode("utf-8", "surrogateescape"))
        assert numerics.read(tmp_path, gguf) == record
        assert memo.read_text() == true


def test_models_that_cannot_load_and_memory_too_small_through_the_cli(gsm8k_tiny, tmp_path):
    """Each is one line that names what is wrong and a fix the command accepts."""
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "nopeformer"}))
    cases = {
        "typo": (["model.path=qwen2.5-coder-05b"], "did you mean model.path=qwen2.5-coder-0.5b?"),
        "model_type": ([f"model.path={unknown}"], "its config.json has model_type 'nopeformer', which transformers"),
        "gguf_architecture": (
            [f"model.path={odd_gguf(tmp_path / 'odd.gguf', tokenizer=True)}", f"model.cache_dir={tmp_path / 'cache'}"],
            "transformers does not load GGUF architecture 'oddformer'",
        ),
        "gguf_padding": (
            [
                f"model.path={write_gguf(tmp_path / 'padded.gguf', QWEN2, pad=10**6)}",
                f"model.cache_dir={tmp_path / 'c2'}",
            ],
            "padded.gguf: transformers cannot read its tokenizer (IndexError",
        ),
        "kv_memory": (
            [f"model.path={gsm8k_tiny}", "model.kv_memory=0.000000001", "decoder=ar"],
            "raise model.kv_memory or model.kv_memory_mb, or lower the tokens a request may generate (tot.solve: "
            "gen.max_thought_tokens, gen.max_eval_tokens, search.max_tokens",
        ),
    }

    # A hub id while the hub cannot be reached (a closed local port stands for it), and a path that is not here.
    cases["hub"] = (
        ["model.path=someorg/some-model-7b"],
        "nor in the Hugging Face cache, and http://127.0.0.1:9 cannot",
    )
    cases["path"] = ([f"model.path={tmp_path / 'no' / 'such'}"], "does not exist (and is not a Hugging Face id)")
    hub = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    hub |= {"no_proxy": "*", "NO_PROXY": "*"}  # the hub itself, whatever proxy this machine names
    # Behind a proxy the proxy is what must answer (a closed port stands for one that is down).
    cases["proxy"] = (["model.path=someorg/some-model-7b"], "cannot be reached through the proxy http://127.0.0.1:7 ")
    proxied = {
        **hub,
        "http_proxy": "http://127.0.0.1:7",
        "HTTP_PROXY": "http://127.0.0.1:7",
        "no_proxy": "",
        "NO_PROXY": "",
    }
    lines = error_lines(tmp_path, {case: args for case, (args, _) in cases.items()}, {"hub": hub, "proxy": proxied})
    for case, (_, expected) in cases.items():
        assert expected in lines[case], lines[case]
