"""The bucketed forward (decoding/runtime/static_forward.py) against the unpadded one: the same logits
for every real token, the same cache contents in every live row (padding writes only the spare row),
in buckets, past the largest one, with draft-tree levels and with rows that are a subset; and its
options checked at load. On a GPU (TOT_TEST_DEVICE=cuda) the bucketed forwards replay CUDA graphs."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, TEST_BUCKETS, build_model, build_tokenizer

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.api.kinds import DECODERS
from decoding.base.errors import BackendError, ConfigError
from decoding.base.values import GenRequest
from decoding.runtime import static_forward as sf
from decoding.runtime.models import ModelSpec, load_model, prepare_for_inference
from decoding.runtime.runner import ModelRunner
from decoding.runtime.static_forward import Buckets, StaticSpec, resolve_graphs

CAPTURE = DEVICE.type == "cuda"
ROOT = Path(__file__).resolve().parents[1]


def same(a: torch.Tensor, b: torch.Tensor, exact: bool = True) -> None:
    """Bitwise on the CPU's invariant path (its kernels do not depend on the batch); float32
    rounding on a GPU, whose kernels are chosen by shape, and under sdpa."""
    if DEVICE.type == "cpu" and exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)


def both(tiny_model) -> tuple[ModelRunner, ModelRunner]:
    plain = ModelRunner(tiny_model)
    bucketed = ModelRunner(tiny_model, static=StaticSpec(TEST_BUCKETS, capture=CAPTURE), strict_graphs=True)
    return plain, bucketed


def random_tree(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Visibility [n, n] and depths [n] of a random tree whose node 0 is the root."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    vis = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for t in range(n):
        node = t
        while node >= 0:
            vis[t, node] = True
            depth[t] += 1
            node = parents[node]
    return vis, depth - 1


@pytest.fixture(scope="module")
def sdpa_model(tiny_model):
    """The tiny model under sdpa in float32 (the attention a GPU runs, folded in the bucketed forward)."""
    model = copy.deepcopy(tiny_model)
    prepare_for_inference(model, DEVICE, "float32", "sdpa", prepack=False)
    return model


@pytest.mark.parametrize("attn", ["default", "sdpa", "qwen2"])
@pytest.mark.parametrize(
    "rows, n_new, lens",
    [
        (None, 1, [5, 9, 2]),  # all rows, one token: a 4-row bucket with a pad row
        ([2, 0], 3, [11, 4, 7]),  # a subset in another order, 3 tokens padded to 4
        ([1], 8, [20, 3, 6]),  # the largest token bucket exactly
        (None, 11, [5, 9, 2]),  # past the largest token bucket: eager at its own shape
        ([0, 1, 2, 3, 4], 2, [3, 3, 8, 1, 6]),  # past the largest row bucket
    ],
)
def test_bucketed_logits_and_cache_are_the_unpadded_ones(tiny_model, tiny_qwen2, sdpa_model, attn, rows, n_new, lens):
    """qwen2: a tiny Qwen2 (q, k and v biases) on the default attention."""
    batch = len(lens)
    results = []
    exact = attn != "sdpa"
    for runner in both({"default": tiny_model, "sdpa": sdpa_model, "qwen2": tiny_qwen2}[attn]):
        gen = torch.Generator().manual_seed(n_new)
        cache = runner.new_cache(batch, 48, graphs=True)
        # Committed prefixes of the given lengths, one causal forward per row.
        for r, n in enumerate(lens):
            g = torch.Generator().manual_seed(r)
            prompt = torch.randint(3, 100, (1, n), generator=g)
            causal = torch.ones(1, n, n, dtype=torch.bool).tril()
            runner.forward(cache, prompt, causal, torch.arange(n)[None], rows=[r])
            cache.advance(torch.tensor([n if i == r else 0 for i in range(batch)]))
        active = list(range(batch)) if rows is None else rows
        g = torch.Generator().manual_seed(99)
        trees = [random_tree(n_new, g) for _ in active]
        tree = torch.stack([v for v, _ in trees])
        depth = torch.stack([d for _, d in trees])
        tokens = torch.randint(3, 100, (len(active), n_new), generator=gen)
        logits = runner.forward(cache, tokens, tree, depth, rows=rows).logits
        results.append((logits, cache))
    (plain, plain_cache), (padded, padded_cache) = results
    same(padded, plain, exact)
    assert padded_cache.lens.tolist() == plain_cache.lens.tolist()
    for row in range(plain_cache.batch):  # (the unpadded cache is paged on the CPU layers)
        a, b = plain_cache.read(row, 0, 48), padded_cache.read(row, 0, 48)
        for x, y in zip(a[0] + a[1], b[0] + b[1]):
            same(y, x, exact)  # padding wrote nothing into a live row


def test_folded_attention_takes_sdpa_output_in_a_gpu_layout(sdpa_model, monkeypatch):
    """CUDA's sdpa kernels return [B, H, T, D] stored as [B, T, H, D]: the folded attention unfolds
    that layout too (a `view` of it failed every bucketed test through graphs on an H100)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gpu_layout(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    plain, bucketed = both(sdpa_model)
    tokens, causal = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, 3, dtype=torch.bool).tril()
    expected = plain.forward(plain.new_cache(1, 16), tokens, causal, torch.arange(3)[None]).logits
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    got = bucketed.forward(bucketed.new_cache(1, 16, graphs=True), tokens, causal, torch.arange(3)[None]).logits
    same(got, expected, exact=False)


def test_tree_levels_after_earlier_forwards_of_the_step(tiny_model):
    """A drafter grows its tree level by level (`offset` uncommitted slots before the new ones):
    each level sees the earlier ones, in buckets as unpadded."""
    out = []
    for runner in both(tiny_model):
        cache = runner.new_cache(2, 40, graphs=True)
        prompt = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
        causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, -1, -1)
        runner.forward(cache, prompt, causal, torch.arange(6).expand(2, -1))
        cache.advance(torch.tensor([6, 6]))
        first = runner.forward(
            cache, torch.tensor([[5], [6]]), torch.ones(2, 1, 1, dtype=torch.bool), torch.zeros(2, 1)
        ).logits
        # The second level: two children of the first token, each seeing it and itself.
        see = torch.tensor([[True, True, False], [True, False, True]]).expand(2, -1, -1)
        second = runner.forward(
            cache, torch.tensor([[7, 8], [9, 10]]), see, torch.ones(2, 2, dtype=torch.long), offset=1
        ).logits
        out.append((first, second))
    same(out[1][0], out[0][0])
    same(out[1][1], out[0][1])


def test_graphs_are_kept_per_bucket_and_dropped_when_the_cache_grows(tiny_model):
    _, runner = both(tiny_model)
    cache = runner.new_cache(2, 16, graphs=True)
    step = torch.ones(2, 1, 1, dtype=torch.bool)
    for _ in range(3):
        runner.forward(cache, torch.tensor([[5], [6]]), step, torch.zeros(2, 1, dtype=torch.long))
        cache.advance(torch.tensor([1, 1]))
    stats = runner.static.stats
    if CAPTURE:
        assert (stats.captured, stats.replayed) == (1, 3)  # one bucket, captured once
        assert len(cache.graphs) == 2  # the bucket's graph and the pool it was captured into
    else:
        assert stats.eager == 3
    cache.reserve(4, 32)
    assert not cache.graphs  # they read the old tensors
    scratch = runner.new_cache(1, 16)  # a scratch cache: nobody captures over it
    runner.forward(scratch, torch.tensor([[5, 6]]), torch.ones(1, 2, 2, dtype=torch.bool).tril(), torch.arange(2)[None])
    assert scratch.graphs is None


class _Replay:
    """A CUDA graph's replay as the CPU can run it: the captured forward again, over the same input
    buffers and cache, into the same output buffer."""

    def __init__(self, run) -> None:
        self.replay = run


def _emulated_capture(self, cache, inputs, positions, reads):
    out = self._forward(cache, inputs, positions, reads).clone()
    return sf._Graph(inputs, out, _Replay(lambda: out.copy_(self._forward(cache, inputs, positions, reads))))


@pytest.mark.parametrize("name", ["ar", "seed_stand", "sd"])
def test_replayed_graphs_decode_what_the_unpadded_forward_does(name, loaded, perturbed, monkeypatch):
    """Forwards replayed from CUDA graphs decode the unpadded forward's tokens, greedy and sampled.
    On the CPU, graphs' replay semantics emulated (input buffers filled per forward, one output
    buffer per bucket, graphs kept per cache and dropped when it grows, the pool rounded up to
    buckets) give the same tokens."""
    if not CAPTURE:
        monkeypatch.setattr(sf.StaticForward, "_capture", _emulated_capture)
    static = StaticSpec(TEST_BUCKETS, capture=True)
    replayed = dataclasses.replace(loaded, static=static, strict_graphs=True)
    replayed_draft = dataclasses.replace(perturbed, static=static)
    requests = [
        GenRequest(p, max_new_tokens=m, temperature=t, seed=i)
        for i, (p, m, t) in enumerate(
            [("the cat", 18, 0.0), ("hello world", 9, 0.9), ("a", 25, 0.0), ("once", 12, 1.1)]
        )
    ]
    draft = DECODERS[name].draft_model == "required"
    config = DecoderConfig(name, draft=ModelSpec(key="draft") if draft else None)
    plain = Engine(loaded, config, perturbed if draft else None).generate(requests)
    engine = Engine(replayed, config, replayed_draft if draft else None)
    assert [r.token_ids for r in engine.generate(requests)] == [r.token_ids for r in plain]
    stats = engine.target.static.stats
    assert stats.captured > 0 and stats.replayed > stats.captured


def test_the_default_takes_graphs_on_cuda_and_the_unpadded_forward_elsewhere(tmp_path):
    """model.cuda_graphs=auto (the default): a Llama checkpoint on CUDA decodes from replayed graphs
    and `hf`'s tokens; on a CPU it loads without buckets."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelSpec(path=str(tmp_path), device=DEVICE.type, weights="float32", activations="float"))
    if not CAPTURE:
        assert loaded.static is None
        return
    assert loaded.static == StaticSpec(Buckets(), capture=True) and not loaded.strict_graphs
    requests = [GenRequest(p, max_new_tokens=12) for p in ("the cat", "hello world")]
    plain = Engine(dataclasses.replace(loaded, static=None), DecoderConfig("hf")).generate(requests)
    engine = Engine(loaded, DecoderConfig("ar"))
    assert [r.token_ids for r in engine.generate(requests)] == [r.token_ids for r in plain]
    assert engine.target.static.stats.replayed > 0


def test_bucket_options_are_checked_at_load():
    with pytest.raises(ConfigError, match="graph_rows"):
        Buckets(rows=(1, 4, 2))
    with pytest.raises(ConfigError, match="graph_tokens"):
        Buckets(tokens=(0, 1))
    with pytest.raises(ConfigError, match="graph_context"):
        ModelSpec(graph_context=0)
    with pytest.raises(BackendError, match="cuda_graphs"):
        ModelSpec(cuda_graphs="maybe")
    assert resolve_graphs("auto", torch.device("cpu"), Buckets()) is None
    assert resolve_graphs("auto", torch.device("cuda"), Buckets()) == StaticSpec(Buckets(), capture=True)
    assert resolve_graphs("eager", torch.device("cpu"), Buckets()) == StaticSpec(Buckets(), capture=False)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        resolve_graphs("on", torch.device("cpu"), Buckets())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_graphs_on_without_cuda_is_one_line(tmp_path):
    cmd = [sys.executable, "-m", "decoding.profile_forward", "model.cuda_graphs=on", "model.device=cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: model.cuda_graphs=on needs a CUDA device, not cpu; use model.cuda_graphs=auto "
        "(or eager for the same bucketed forward without capture)"
    ]


def gpu_check_module():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_the_gpu_checks_decode_rows_say_where_the_walk_ran(loaded):
    """A decode item's fourth field is `verify.walk`: the same tokens walked on the host and where the
    logits are, each row with the host's milliseconds a step (what the walk on a GPU is to cut)."""
    gpu_check = gpu_check_module()
    questions = ["once upon a time there was", "the cat sat on the"]
    rows = [gpu_check.decode(loaded, questions, "seed_stand", 2, 12, None, walk) for walk in ("host", "device")]
    assert [r["walk"] for r in rows] == ["host", "device"]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0
    assert all(r["host_ms_per_step"] > 0 for r in rows)


def test_the_gpu_checks_transformers_step_is_a_forward_on_its_cached_prompt(tmp_path, capsys, tokenizer):
    """The baseline beside the graphs-on forward: `transformers`' own step on its StaticCache gives the
    logits of the whole sequence's forward at the new positions, the same at every call; its table runs
    every shape (eager here: a capture needs CUDA) and the printed table puts it beside the project's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from decoding.shapes import write_shape

    gpu_check = gpu_check_module()
    shape = write_shape("tiny", tmp_path / "tiny", tokenizer)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32).eval()
    rows, tokens, context = 2, 3, 5
    step = gpu_check.hf_step(model, rows, tokens, context, graph=False)
    draw = torch.Generator().manual_seed(0)
    prompt = torch.randint(model.config.vocab_size, (rows, context), generator=draw)
    new = torch.randint(model.config.vocab_size, (rows, tokens), generator=draw)
    with torch.inference_mode():
        whole = model(torch.cat([prompt, new], dim=1)).logits[:, context:]
    first, again = step(), step()
    torch.testing.assert_close(first, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(first, again)
    table = gpu_check.hf_table(shape, torch.float32, repeats=2, graph=False)
    assert [(r["rows"], r["tokens"]) for r in table] == gpu_check.SHAPES and all(r["ms"] > 0 for r in table)
    on = [{"mode": "on", "rows": b, "tokens": t, "ms": 2.0, "gpu_busy": 0.5} for b, t in gpu_check.SHAPES]
    ref = [{**r, "mode": "hf_graph", "ms": 1.0} for r in table[:-1]] + [{**table[-1], "mode": "hf_graph", "error": "X"}]
    del ref[-1]["ms"]
    gpu_check.print_forward_table(on + ref, ["on"])
    lines = capsys.readouterr().out.splitlines()
    assert "| 1 x 1 | 2.00 (50%) | 1.00 | 2.00x |" in lines and "| 8 x 64 | 2.00 (50%) | X | - |" in lines


@pytest.mark.slow
def test_the_gpu_checks_bfs_part_runs_tot_bench_at_one_and_four_problems(tmp_path):
    """The ToT part: `ar` and `seed_stand` at one and four problems in flight, their speeds read from
    tot.bench's own file (its trees held to ar's by tot.bench); here on the CPU, one short problem."""
    gpu_check = gpu_check_module()
    short = ("data.limit=1", "search.n_thoughts=2", "task.depth=2", "gen.max_thought_tokens=12")
    result = gpu_check.bfs_bench(tmp_path, ROOT / "tasks/data/gsm8k_examples.jsonl", "smollm2-135m", 600, "cpu", short)
    assert result["rc"] == 0, (tmp_path / "bfs.log").read_text()[-2000:]
    assert set(result["decoders"]) == {"ar", "seed_stand", "ar_4", "seed_stand_4"}
    assert result["decoders"]["seed_stand_4"]["concurrency"] == 4 and result["decoders"]["ar"]["tokens_per_s"] > 0


def test_the_gpu_check_runs_the_makefiles_cuda_list():
    """tools/gpu_check.py runs `make test-cuda`'s files (one list, in the Makefile), each a real file;
    without a GPU it says so in one line."""
    gpu_check = gpu_check_module()
    files = gpu_check.cuda_test_files()
    assert "tests/test_static_forward.py" in files and "tests/test_continuous.py" in files
    assert all((ROOT / f).is_file() for f in files)
    if not torch.cuda.is_available():
        run = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "a", "b"], capture_output=True, text=True
        )
        assert run.returncode == 2 and run.stderr.strip().splitlines() == [
            "error: tools/gpu_check.py measures a GPU and none is visible; on a CPU use make test"
        ]
