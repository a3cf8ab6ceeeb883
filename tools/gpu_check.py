"""The GPU check of one device call: the 8B shape's forward and decode, CUDA graphs off and on, beside
`transformers`' own forward on its static cache captured as a CUDA graph; ToT-BFS on the embedded model
(`ar` and `seed_stand`, one and four problems in flight, by `tot.bench`); then the CUDA test list
(`make test-cuda`) in what time is left. docs/tools.md says how to run it.

    python3 tools/gpu_check.py SHAPE_DIR OUT_DIR [--budget SECONDS] [--parts tests,forward,hf,decode,bfs]

SHAPE_DIR is a `python -m decoding.shapes llama-3.1-8b DIR` folder (random weights are built on the
GPU); OUT_DIR gets check.json (every figure), tests.log and bfs/ (tot.bench's folder). The model is
loaded once and each measurement runs with graphs off and on in the same process, the baseline beside
the method; `transformers`' graph is timed in the same process on the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, without an install

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.values import GenRequest
from decoding.drafters.load import load_draft
from decoding.runtime.models import LoadedModel, load_model
from decoding.runtime.pretrained import pretrained
from decoding.runtime.runner import ModelRunner
from decoding.runtime.spec import Buckets, ModelSpec
from decoding.runtime.static_forward import resolve_graphs
from decoding.runtime.time_split import gpu_busy
from decoding.speculation.timing import timed_ms, verification

SHAPES = [(1, 1), (8, 1), (32, 1), (1, 16), (8, 16), (8, 64)]  # (rows, tokens per row)
CONTEXT = 300
ROOT = Path(__file__).resolve().parents[1]
# A measurement's figures, JSON-shaped: the rows and parts of check.json.
Row = dict[str, Any]


def cuda_test_files() -> list[str]:
    """The Makefile's CUDA_TESTS (what `make test-cuda` runs), one list for both."""
    text = (ROOT / "Makefile").read_text()
    names = re.search(r"^CUDA_TESTS := ((?:.*\\\n)*.*)$", text, re.M)
    assert names, "the Makefile has no CUDA_TESTS list"
    return [f"tests/test_{n}.py" for n in names.group(1).replace("\\", " ").split()]


def _repeated(step: Callable[[], object], n: int) -> list[object]:
    return [step() for _ in range(n)]


def forward_table(loaded: LoadedModel, modes: dict[str, LoadedModel], repeats: int) -> list[Row]:
    rows: list[Row] = []
    for rows_n, tokens in SHAPES:
        for mode, variant in modes.items():
            runner = ModelRunner(variant.model, static=variant.static, strict_graphs=variant.strict_graphs)
            step = verification(runner, CONTEXT, tokens, rows_n)
            times = timed_ms(step, repeats, runner.device)
            busy = gpu_busy(functools.partial(_repeated, step, repeats))[1]
            row: Row = {"mode": mode, "rows": rows_n, "tokens": tokens, "ms": statistics.median(times)}
            row |= {"ms_min": min(times), "gpu_busy": busy}
            if runner.static is not None:
                row["capture_s"] = runner.static.stats.capture_s
            rows.append(row)
            print(
                f"forward {rows_n} x {tokens} graphs {mode}: {row['ms']:.2f} ms, GPU busy {100 * busy:.0f}%", flush=True
            )
    return rows


def hf_step(model: torch.nn.Module, rows: int, tokens: int, context: int, graph: bool) -> Callable[[], object]:
    """`transformers`' own forward of `tokens` new tokens a row after `context` cached ones, on its
    StaticCache rewound to `context` first (a device-side fill, so the same positions are rewritten with
    the same keys at every call), captured as one CUDA graph (graph=True: what `transformers`'
    static-cache generation replays a step) or eager."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    device = next(model.parameters()).device
    config = pretrained(model).config
    cache = StaticCache(config=config, max_cache_len=context + tokens)
    draw = torch.Generator().manual_seed(0)
    prompt = torch.randint(config.vocab_size, (rows, context), generator=draw).to(device)
    new = torch.randint(config.vocab_size, (rows, tokens), generator=draw).to(device)
    position = torch.arange(context, context + tokens, device=device).expand(rows, tokens)

    with torch.inference_mode():
        model(prompt, cache=cache, use_cache=True)
    # Narrowed here, out of the timed forward: a StaticLayer's count is a tensor, rewound on the device.
    layers = [layer for layer in cache.layers if isinstance(layer, StaticLayer)]
    assert len(layers) == len(cache.layers), "a StaticCache's layers are all StaticLayers"

    def forward() -> torch.Tensor:
        for layer in layers:
            layer.cumulative_length.fill_(context)
        with torch.inference_mode():
            logits: torch.Tensor = model(new, cache=cache, position_ids=position, use_cache=True).logits
            return logits

    if not graph:
        return forward
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        forward()
    return captured.replay


def hf_table(shape: Path, dtype: torch.dtype, repeats: int, graph: bool = True) -> list[Row]:
    """`transformers`' model of the shape's config (random weights, the project's dtype) on every
    SHAPES entry; a shape whose capture fails is a row with its error, not the end of the check."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if graph else "cpu")
    with device:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=dtype).eval()
    rows: list[Row] = []
    for rows_n, tokens in SHAPES:
        row: Row = {"mode": "hf_graph" if graph else "hf_eager", "rows": rows_n, "tokens": tokens}
        try:
            times = timed_ms(hf_step(model, rows_n, tokens, CONTEXT, graph), repeats, device)
            row |= {"ms": statistics.median(times), "ms_min": min(times)}
            print(f"forward {rows_n} x {tokens} transformers' graph: {row['ms']:.2f} ms", flush=True)
        except Exception as e:  # a failed capture is a finding: the other shapes still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"forward {rows_n} x {tokens} transformers' graph: {row['error']}", flush=True)
        rows.append(row)
    del model
    return rows


def bfs_bench(
    out: Path, questions: Path, model: str, seconds: int, device: str = "cuda", extra: tuple[str, ...] = ()
) -> Row:
    """ToT-BFS on the embedded model by `tot.bench`: `ar` and `seed_stand` at one problem in flight and at
    four (tot.bench exits 1 where a tree differs from `ar`'s); tokens/s and the speed-ups it printed."""
    variants = "{ar_4: {decoder: ar, run.concurrency: 4}, seed_stand_4: {decoder: seed_stand, run.concurrency: 4}}"
    cmd = [sys.executable, "-m", "tot.bench", "task=gsm8k", f"data.path={questions}", "data.limit=4"]
    cmd += [f"model={model}" if "/" not in model else f"model.path={model}", f"model.device={device}"]
    cmd += ["bench.decoders=[ar,seed_stand]", f"bench.variants={variants}", "run.concurrency=1"]
    cmd += [f"hydra.run.dir={out / 'bfs'}", *extra]
    try:
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout"}
    (out / "bfs.log").write_text(run.stdout + run.stderr)
    result: Row = {"rc": run.returncode}
    if (out / "bfs" / "bench.json").is_file():
        rows = json.loads((out / "bfs" / "bench.json").read_text())["decoders"]
        keep = ("tokens_per_s", "speedup_vs_ar", "acceptance_length", "forwards_per_token", "concurrency")
        result["decoders"] = {name: {k: r.get(k) for k in keep} for name, r in rows.items()}
    return result


def decoder_config(decoder: str, draft: str | None, walk: str = "auto") -> DecoderConfig:
    """The decoder's options as `decoding.generate decoder=NAME [draft.path=...] verify.walk=WALK` reads them."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    overrides = [f"decoder={decoder}", "prompts=-", "out=-", f"verify.walk={walk}"]
    overrides += [f"draft.path={draft}"] if draft else []
    with initialize_config_module("conf", version_base="1.3"):
        cfg = compose("generate", overrides=overrides)
    container = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
    return DecoderConfig.from_container(container)


def decode(
    variant: LoadedModel, questions: list[str], decoder: str, n: int, tokens: int, draft: str | None, walk: str = "auto"
) -> Row:
    """`decoder` on the first n questions, `tokens` each, after a warm-up call; tokens/s, ms a forward
    and the host's ms a step (`verify.walk`: where the tree walk runs)."""
    config = decoder_config(decoder, draft, walk)
    engine = Engine(variant, config, load_draft(config.draft, variant) if config.draft else None)
    questions = questions[:n]
    requests = [GenRequest(q, max_new_tokens=tokens, seed=i) for i, q in enumerate(questions)]
    t0 = time.perf_counter()
    engine.generate(requests[:1] if n > 1 else requests)  # warm-up: CUDA start-up, capture, the planner's profile
    warm_s = time.perf_counter() - t0
    engine.generate(requests)
    s = engine.last_stats
    out = {
        "decoder": decoder,
        "draft": draft,
        "walk": walk,
        "sequences": n,
        "tokens": s.generated_tokens,
        "wall_s": s.wall_s,
        "tokens_per_s": s.generated_tokens / s.wall_s,
        "ms_per_forward": 1000 * s.wall_s / max(s.target_forwards, 1),
        "acceptance_length": s.acceptance_length,
        "host_ms_per_step": s.schedule.host_ms_per_step,
        "warmup_s": warm_s,
    }
    return out


def run_tests(out: Path, seconds: int) -> Row:
    """The CUDA test list on 16 workers; each test's outcome is logged as it ends (-v), so a run cut
    by the budget still names what failed."""
    files = cuda_test_files()
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfE", "-m", "not slow", "-n", "16"]
    cmd += ["-p", "no:cacheprovider", "-W", "ignore::pytest.PytestWarning", *files]
    env = os.environ | {"TOT_TEST_DEVICE": "cuda", "TOT_TEST_FAILURES": str(out / "failures.log")}
    t0 = time.perf_counter()
    with open(out / "tests.log", "w") as log:
        try:
            rc: int | str = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=seconds
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = (out / "tests.log").read_text()
    return {
        "rc": rc,
        "s": time.perf_counter() - t0,
        "passed": text.count(" PASSED "),
        "failed": [line.split(" FAILED ")[-1] for line in text.splitlines() if " FAILED " in line],
    }


def print_forward_table(forward: list[Row], modes: list[str]) -> None:
    """The forward's figures a shape a line: each graphs mode (GPU busy), `transformers`' graph and the
    project's graphs-on time over it."""
    by = {(r["mode"], r["rows"], r["tokens"]): r for r in forward}
    if not by:
        return
    hf = any(r["mode"] == "hf_graph" for r in forward)
    head = [f"graphs {m} ms (GPU busy)" for m in modes]
    head += ["transformers' graph ms", "on / transformers'"] if hf else []
    print("\n| rows x tokens | " + " | ".join(head) + " |")
    for b, t in SHAPES:
        cells = [f"{c['ms']:.2f} ({c['gpu_busy']:.0%})" if c else "-" for c in (by.get((m, b, t)) for m in modes)]
        if hf:
            ref, on = by.get(("hf_graph", b, t), {}), by.get(("on", b, t))
            cells.append(f"{ref['ms']:.2f}" if "ms" in ref else ref.get("error", "-"))
            cells.append(f"{on['ms'] / ref['ms']:.2f}x" if on and "ms" in ref else "-")
        print(f"| {b} x {t} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--parts", default="forward,hf,decode,bfs,tests", help="which parts, in this order")
    parser.add_argument("--modes", default="off,on", help="graphs off and/or on")
    parser.add_argument(
        "--decode",
        default="ar:1,ar:32,sd:1:self,seed_stand:1,seed_stand:1::host,seed_stand:32,seed_stand:32::host",
        help="decoder:sequences[:draft.path[:verify.walk]], ...",
    )
    parser.add_argument("--questions", type=Path, default=Path("../shared/data/gsm8k/test.jsonl"))
    parser.add_argument("--bfs-model", default="smollm2-135m", help="bfs: the embedded model's name or a GGUF path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: tools/gpu_check.py measures a GPU and none is visible; on a CPU use make test", file=sys.stderr)
        sys.exit(2)
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    questions = [json.loads(line)["question"] for line in args.questions.read_text().splitlines()[:32]]
    about = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip(),
    }
    import transformers

    about["transformers"] = transformers.__version__
    print(about, flush=True)
    result: dict[str, Any] = {"about": about, "forward": [], "decode": []}
    parts = args.parts.split(",")
    if "tests" in parts and parts[0] == "tests":  # first: its own share of the budget, then the rest
        result["tests"] = run_tests(args.out, int(0.6 * args.budget))
        print("tests:", result["tests"], flush=True)
    if any(p in parts for p in ("forward", "hf", "decode")):
        loaded = load_model(ModelSpec(path=str(args.shape), init="random", cuda_graphs="off"))
        on = dataclasses.replace(loaded, static=resolve_graphs("on", loaded.device, Buckets()), strict_graphs=True)
        modes = {m: {"off": loaded, "on": on}[m] for m in args.modes.split(",")}
        if "forward" in parts:
            result["forward"] = forward_table(loaded, modes, args.repeats)
            (args.out / "check.json").write_text(json.dumps(result, indent=1))
        if "hf" in parts:
            dtype = next(loaded.model.parameters()).dtype
            result["forward"] += hf_table(args.shape, dtype, args.repeats)
            torch.cuda.empty_cache()
            (args.out / "check.json").write_text(json.dumps(result, indent=1))
        for item in args.decode.split(",") if "decode" in parts else []:
            decoder, n, *rest = item.split(":")
            draft = rest[0] if rest and rest[0] else None  # "seed_stand:1::host": no draft model
            walk = rest[1] if len(rest) > 1 else "auto"
            for mode, variant in modes.items():
                if time.perf_counter() - start > 0.8 * args.budget:
                    print(f"skipped {item} graphs {mode}: the budget", flush=True)
                    continue
                row = {"mode": mode, **decode(variant, questions, decoder, int(n), 256, draft, walk)}
                result["decode"].append(row)
                print(
                    f"decode {item} graphs {mode}: {row['tokens_per_s']:.1f} tok/s, "
                    f"{row['ms_per_forward']:.2f} ms/forward, host {row['host_ms_per_step']:.2f} ms/step, "
                    f"acceptance {row['acceptance_length']:.2f}",
                    flush=True,
                )
                (args.out / "check.json").write_text(json.dumps(result, indent=1))
        del loaded, on, modes
        torch.cuda.empty_cache()
    if "bfs" in parts:
        seconds = max(60, int(0.9 * args.budget - (time.perf_counter() - start)))
        result["bfs"] = bfs_bench(args.out.resolve(), args.questions.resolve(), args.bfs_model, seconds)
        print("bfs:", result["bfs"], flush=True)
        (args.out / "check.json").write_text(json.dumps(result, indent=1))
    if "tests" in parts and parts[0] != "tests":
        result["tests"] = run_tests(args.out, max(30, int(args.budget - (time.perf_counter() - start))))
        print("tests:", result["tests"], flush=True)
    (args.out / "check.json").write_text(json.dumps(result, indent=1))
    print_forward_table(result["forward"], args.modes.split(","))
    for r in result["decode"]:
        print(r)


if __name__ == "__main__":
    main()
