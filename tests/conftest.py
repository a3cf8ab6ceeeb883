"""Fixtures for fast tests: a tiny random Llama and a tiny byte-level BPE tokenizer, built in memory."""

from __future__ import annotations

import copy
import dataclasses
import os
import string
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from llama_server import LlamaServer, llama_server
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from decoding.api.engine import Engine
from decoding.runtime.models import LoadedModel, embedded_file, prepare_for_inference
from decoding.runtime.rows_linear import resolve_linear
from decoding.runtime.static_forward import Buckets, StaticSpec
from decoding.speculation.draft_tree import k_config_parents
from decoding.trees.static import StaticTree

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
# Llama's layers under another class: what an architecture plug-in adds (tests/test_plugins.py).
ARCHS["mistral"] = (lambda **kw: MistralConfig(sliding_window=None, **kw), MistralForCausalLM)

SPECIALS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2
# TOT_TEST_DEVICE=cuda runs the fixtures' models on a GPU (docs/performance.md, "On a GPU"): float32
# with TF32 off and sdpa, where a token's logits do not depend on the batch for these shapes; the
# CPU default is the product's own path, bfloat16 with the batch-invariant attention.
DEVICE = torch.device(os.environ.get("TOT_TEST_DEVICE", "cpu"))
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def _byte_char(c: str) -> str:
    """The character GPT-2's byte-level alphabet uses for an ASCII character (a space is 'Ġ')."""
    return "Ġ" if c == " " else c


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE over printable ASCII with some multi-character tokens, so any id decodes to text.

    Every non-special token is printable ASCII (one to three characters), so any sequence of ids the
    random model emits decodes to plain text, which stop-string tests need.
    """
    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}
    for code in range(32, 127):
        vocab.setdefault(_byte_char(chr(code)), len(vocab))
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    common = "etaoinshrdlu"
    for a in common:
        for b in common:
            merge(a, b)
    for c in string.ascii_lowercase + string.digits:
        merge("Ġ", c)
    for w in ("the", "and", "ing", "ion"):
        merge(w[:2], w[2])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def pytest_configure(config: pytest.Config) -> None:
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.exit("TOT_TEST_DEVICE=cuda but no CUDA device is visible; unset it to test on the CPU", returncode=2)
    # Under parallel workers each takes its share of the cores, for its own torch and the commands it
    # starts (they read OMP_NUM_THREADS): two workers at two threads each on two cores spent a quarter
    # more CPU time spinning than they computed.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked slow (minutes each, on real models) first: under parallel workers (make test
    runs pytest-xdist) they start at once and the short ones fill in beside them, where last they
    would end the run alone on one worker. Otherwise the order stays."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With TOT_TEST_FAILURES=PATH each failure is appended there as it happens: a run cut short (a
    device call's time limit, tools/gpu_check.py) still says why each test failed, where pytest's
    own summary comes only at the end. (Under xdist the controller writes it again.)"""
    path = os.environ.get("TOT_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest):
    """Fast tests run tiny tensors, where torch's intra-op threads only cost: on a busy 2-core machine
    they made the decoder tests ~50x slower. Tests marked slow keep the default thread count."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


def build_model(
    vocab_size: int, seed: int = 0, max_positions: int = 512, arch: str = "llama", hidden: int = 64
) -> torch.nn.Module:
    """A tiny random causal LM of `arch` (a key of ARCHS; qwen2's q, k and v biases are given random
    values here so that they count), `hidden` wide with an MLP twice as wide."""
    torch.manual_seed(seed)
    config_type, model_type = ARCHS[arch]
    config = config_type(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        # Larger than the default 0.02 so that next-token distributions are peaked rather than near
        # uniform: greedy continuations vary and the sampling tests have a small effective support.
        initializer_range=0.2,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = model_type(config).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("_proj.bias"):
            p.normal_(std=0.2)
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        prepare_for_inference(model, DEVICE, "float32", "sdpa")
    else:  # the default CPU path of load_model: bfloat16 weights, the batch-invariant attention, the
        # machine's default kernel for bfloat16 linears (decoding/runtime/rows_linear.py)
        prepare_for_inference(model, DEVICE, "bfloat16", "invariant", linear=resolve_linear("auto", DEVICE))
    return model


@pytest.fixture(scope="session")
def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return build_model(len(tokenizer))


@pytest.fixture(scope="session")
def gsm8k_tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A tiny random checkpoint on disk with a context long enough for GSM8K's prompts: what a command
    line test loads when the model's outputs are not what it checks (seconds less than the embedded
    model in every command)."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    build_model(len(tokenizer), max_positions=4096).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_qwen2(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    return build_model(len(tokenizer), arch="qwen2")


@pytest.fixture(scope="session")
def loaded(tiny_model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> LoadedModel:
    return LoadedModel(tiny_model, tokenizer, DEVICE, use_chat_template=False, source="tiny")


# Small buckets, so the tests' few rows and trees cross several of them and pass the largest (run
# eagerly there, as past the largest bucket in production); captured on a GPU, eager on the CPU.
TEST_BUCKETS = Buckets(rows=(1, 2, 4), tokens=(1, 2, 4, 8), context=16)


@pytest.fixture(scope="session")
def bucketed(loaded: LoadedModel) -> LoadedModel:
    """The tiny model through the bucketed forward of decoding/runtime/static_forward.py: padded to
    TEST_BUCKETS, replayed from CUDA graphs on a GPU, the same code eagerly on the CPU."""
    return dataclasses.replace(
        loaded, static=StaticSpec(TEST_BUCKETS, capture=DEVICE.type == "cuda"), strict_graphs=True
    )


@pytest.fixture(scope="session")
def bucketed_draft(perturbed: LoadedModel) -> LoadedModel:
    """The draft model of `perturbed` through the same bucketed forward."""
    return dataclasses.replace(
        perturbed, static=StaticSpec(TEST_BUCKETS, capture=DEVICE.type == "cuda"), strict_graphs=True
    )


@pytest.fixture(scope="session")
def make_engine(loaded: LoadedModel):
    """make_engine(decoder) -> Engine on the tiny model; a new Engine each call (fresh stats)."""

    def make(decoder: str = "ar", model: LoadedModel | None = None) -> Engine:
        return Engine(model or loaded, decoder)

    return make


@pytest.fixture(scope="session")
def long_context(tokenizer: PreTrainedTokenizerFast) -> LoadedModel:
    """The tiny model with room for the Blocksworld prompts (long, in a byte-level tokenizer)."""
    return LoadedModel(build_model(len(tokenizer), max_positions=8192), tokenizer, DEVICE, False, "tiny")


@pytest.fixture(scope="session")
def perturbed(tiny_model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> LoadedModel:
    """A draft model close to the target but not equal: some drafts accepted, some rejected."""
    model = copy.deepcopy(tiny_model)
    g = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.add_(0.08 * p.std() * torch.randn(p.shape, generator=g).to(p.device))
    return LoadedModel(model, tokenizer, DEVICE, False, "perturbed")


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """llama.cpp's server on the embedded GGUF file, for the whole session."""
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with llama_server(embedded_file("smollm2-135m"), log) as server:
        yield server


@pytest.fixture(scope="session")
def small_tree(tmp_path_factory) -> str:
    """A small static tree (k_config 3, 2, 1, 1) for the model-free drafters' tests."""
    path = tmp_path_factory.mktemp("trees") / "small.json"
    StaticTree(tuple(k_config_parents((3, 2, 1, 1))), {"made_by": "test"}).save(path)
    return str(path)
