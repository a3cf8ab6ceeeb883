"""`python -m decoding.activation_error`: what model.activations=int8 does to a GGUF model's outputs (Hydra).

On held text (GSM8K test questions with their solutions), the next-token distributions of the model's
4-bit layers run three ways: a float32 dequantization of the same weights (the reference: every
4-bit layer as float32 scale * q + minimum, the rest of the model in float32), `float` (torch's int4
kernel, bfloat16 activations), `int8` (activations quantized per block of 32, the hidden states
between the layers float32) and, where the file has K-quant layers, `int8_256` (their input with a
scale per 256 inputs, llama.cpp's Q8_K rule). Prints, per way,
the mean KL divergence of its next-token distributions from the reference's (nats a token) and the
perplexity of the text; with llama-cpp-python installed, llama.cpp on the same file and tokens too.

A scale per 256 costs little accuracy on most inputs and much on a few (the 1.5B's: one layer's MLP
input carried nearly all of int8_256's KL): before its row is measured, the inputs whose scale per 256 alone
adds a large share of the KL are found by halving (`heavy_inputs`, on the first texts) and kept per 32;
the record names them, and int8_256 runs so wherever the record is read.
"""

from __future__ import annotations

import copy
import gc
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_int, held_rows, held_text
from decoding.runtime import kernels, numerics
from decoding.runtime.activation import use_torch_silu
from decoding.runtime.llama import readers
from decoding.runtime.models import cache_root, gguf_file, load_model
from decoding.runtime.numerics import Numerics
from decoding.runtime.packing import pack
from decoding.runtime.pretrained import decoder, pretrained
from decoding.runtime.quant import INT8_FORMATS, Int4Linear, Q8Linear, k_quant, takes_int8, use_k_block
from decoding.runtime.runner import ModelRunner
from decoding.runtime.spec import ModelSpec
from decoding.speculation.draft_tree import DraftTree


@dataclass(frozen=True)
class ActivationErrorConfig:
    model: ModelSpec
    data: str
    limit: int
    out: str | None
    ship: bool  # the record goes to decoding/runtime/records/ (shipped with the project), not the cache

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> ActivationErrorConfig:
        c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
        data = held_text("data", c["data"])
        limit = as_int("limit", c["limit"])
        if limit < 1:
            raise ConfigError(f"limit={limit} must be a positive number of texts")
        model = replace(ModelSpec.from_config(c["model"]), activations="int8")
        ship = c.get("ship", False)
        if not isinstance(ship, bool):
            raise ConfigError(f"ship={ship!r} must be true or false")
        return cls(model, data, limit, c.get("out"), ship)


@dataclass(frozen=True)
class Error:
    """One way of running the model against the reference, over every predicted token of the texts."""

    kl: float  # mean KL(reference || this way), nats a token
    perplexity: float
    tokens: int


# An input is heavy where its scale per 256 alone adds at least this share of what every input's adds
# (a few heavy inputs at most; below it the error is spread, and keeping inputs per 32 would buy little).
HEAVY_SHARE = 0.25
SEARCH_TEXTS = 4  # the texts the search measures on (the first of `limit`): it measures 2 a halving


def texts(path: str, limit: int) -> list[str]:
    return [f"{r['question']}\n{r['answer']}" for r in held_rows(path)[:limit]]


def float32_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float32 with each 4-bit layer (and a Q8_0 head) as the dense matrix its int8 path
    multiplies by."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, (Int4Linear, Q8Linear)):
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            dense.weight.data = module.dequantized().float()
            if module.bias is not None:
                dense.bias.data = module.bias.float()
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, dense)
    pretrained(ref).set_attn_implementation("sdpa")
    use_torch_silu(ref)
    return ref.float()


def float_activations(model: torch.nn.Module) -> torch.nn.Module:
    """The model as model.activations=float runs it: its 4-bit layers on torch's int4 kernel, its head
    the bfloat16 matrix, torch's SiLU and the rest in bfloat16 (the int8 path's is float32)."""
    out = copy.deepcopy(model)
    head = pretrained(out).get_output_embeddings()
    if isinstance(head, Q8Linear):
        dense = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        assert head.weight is not None, "a Q8_0 head keeps its bfloat16 matrix (quant.py builds it so)"
        dense.weight = head.weight
        if head.bias is not None:  # else dense has none already (bias=False)
            dense.bias = head.bias
        pretrained(out).set_output_embeddings(dense)
    for name, module in list(out.named_modules()):
        if isinstance(module, Int4Linear) and module.activations == "int8":
            scale, minimum = module.scale_minimum()
            layer: torch.nn.Module = Int4Linear(module.codes, scale, minimum, module.bias, "float")
        elif isinstance(module, Q8Linear) and module.weight is None:  # Q8_0 / Q5_0: bfloat16 on the float path
            layer = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            layer.weight.data = module.dequantized()
            if module.bias is not None:
                layer.bias.data = module.bias.detach().clone()
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent) if parent else out, child, layer)
    use_torch_silu(out)
    return out.to(torch.bfloat16)


@torch.inference_mode()
def log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Next-token log-probabilities [T - 1, V] (float64) at every position but the last."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1)


@torch.inference_mode()
def runner_log_probs(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """`log_probs` through the decoders' forward (the C++ layers over the row KV cache, in its type)."""
    cache = runner.new_cache(1, len(ids) + 1)
    packed = pack([ids], [DraftTree()])
    logits = runner.forward(cache, packed.tokens, packed.see, packed.depth).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1)


Way = Callable[[list[int]], torch.Tensor]  # a text's ids -> next-token log-probabilities [T - 1, V]
Input = tuple[str, ...]  # the names of the layers that read one input


def k_quant_inputs(model: torch.nn.Module) -> list[Input]:
    """The inputs int8_256 takes with a scale per 256, each as the names of the K-quant layers that read
    it: per decoder layer q, k and v's, o's, gate and up's, down's (llama.SAME_INPUT), then the head's."""
    names = {m: n for n, m in model.named_modules()}
    inputs = []
    for layer in decoder(model).layers:
        for projections in readers(layer):
            int8 = [cast(Int4Linear | Q8Linear, m) for m in projections if takes_int8(m, alone=True)]
            kept = tuple(names[m] for m in int8 if k_quant(m))
            if kept:
                inputs.append(kept)
    head = pretrained(model).get_output_embeddings()
    if head is not None and takes_int8(head, alone=True) and k_quant(head):
        inputs.append((names[head],))
    return inputs


def heavy_inputs(inputs: Sequence[Input], excess: Callable[[list[Input]], float]) -> list[Input]:
    """The inputs whose scale per 256 alone adds at least HEAVY_SHARE of what all of them add (`excess`:
    the KL added over int8's with these inputs per 256 and the rest per 32), found by halving: a part
    that adds less holds none (disjoint inputs' excesses add up, near enough), so each heavy input costs
    two measurements a halving."""
    total = excess(list(inputs))
    if total <= 0:
        return []
    found: list[Input] = []

    def search(part: list[Input], adds: float) -> None:
        if adds < HEAVY_SHARE * total:
            return
        if len(part) == 1:
            found.append(part[0])
            return
        half = len(part) // 2
        for side in (part[:half], part[half:]):
            search(side, excess(side))

    search(list(inputs), total)
    return found


def kept_per_32(model: torch.nn.Module, reference: Way, texts_ids: list[list[int]]) -> tuple[str, ...]:
    """The layers int8_256 keeps per 32 on this model (`heavy_inputs` on `texts_ids`, the reference
    computed again for each measurement: a 150k vocabulary's log-probabilities are too big to hold);
    `model` is left with those layers per 32 and the other K-quant layers per 256."""
    inputs = k_quant_inputs(model)
    every = [name for names in inputs for name in names]

    def kl(per_32: Sequence[str]) -> float:
        use_k_block(model, INT8_FORMATS["int8_256"], per_32)
        way = partial(runner_log_probs, ModelRunner(model))
        got = measure(reference, {"x": way}, texts_ids)["x"].kl
        del way
        gc.collect()  # the runner's pools go now, not at a later collection: the tool runs near the memory's size
        return got

    base = kl(every)  # int8's own

    def excess(part: list[Input]) -> float:
        per_256 = {name for names in part for name in names}
        adds = kl([name for name in every if name not in per_256]) - base
        print(f"  {len(part)} of {len(inputs)} inputs per 256 (from {part[0][0]}): KL {adds:+.6f}", flush=True)
        return adds

    kept = tuple(name for names in heavy_inputs(inputs, excess) for name in names)
    use_k_block(model, INT8_FORMATS["int8_256"], kept)
    return kept


def measure(reference: Way, ways: dict[str, Way], texts_ids: list[list[int]]) -> dict[str, Error]:
    """Per way, KL(reference || way) and the text's perplexity under it, over every predicted token,
    and the reference's own ("reference", KL 0). Text by text: one text's log-probabilities over a
    150k-token vocabulary take hundreds of MB, all of them would not fit."""
    sums = {name: [0.0, 0.0] for name in ("reference", *ways)}  # KL, negative log-likelihood
    n = 0
    for ids in texts_ids:
        ref, target = reference(ids), torch.tensor(ids[1:])[:, None]
        for name, way in (("reference", None), *ways.items()):
            got = ref if way is None else way(ids)
            sums[name][0] += float((ref.exp() * (ref - got)).sum())
            sums[name][1] -= float(got.gather(1, target).sum())
        n += len(ids) - 1
    return {name: Error(kl / n, math.exp(nll / n), n) for name, (kl, nll) in sums.items()}


def llama_cpp_way(gguf: Path, texts_ids: list[list[int]]) -> Way | None:
    """llama.cpp's next-token log-probabilities on the same tokens, or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    n_ctx = max(len(ids) for ids in texts_ids) + 8
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)

    def way(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.log_softmax(torch.tensor(llm.scores[: len(ids) - 1], dtype=torch.float64), -1)

    return way


@hydra_command("activation_error", groups=("model",))
def main(cfg: DictConfig) -> None:
    try:
        acfg = ActivationErrorConfig.from_omegaconf(cfg)
        loaded = load_model(acfg.model)
        gguf = gguf_file(acfg.model)
        ids = [loaded.tokenizer(t)["input_ids"] for t in texts(acfg.data, acfg.limit)]
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    ref_model = float32_reference(loaded.model)
    supers = copy.deepcopy(loaded.model)
    per_32: tuple[str, ...] = ()
    k_quants = use_k_block(supers, INT8_FORMATS["int8_256"]) > 0
    if k_quants:  # the search first: its memory is free again after it
        per_32 = kept_per_32(supers, lambda i: log_probs(ref_model, i), ids[:SEARCH_TEXTS])
        print(f"int8_256 keeps {len(per_32)} layers' inputs per 32: {', '.join(per_32) or 'none'}", flush=True)
    float_model, runner = float_activations(loaded.model), ModelRunner(loaded.model)
    ways: dict[str, Way] = {"float": lambda i: log_probs(float_model, i), "int8": lambda i: runner_log_probs(runner, i)}
    if k_quants:
        runner_256 = ModelRunner(supers)
        ways["int8_256"] = lambda i: runner_log_probs(runner_256, i)
    by_llama = llama_cpp_way(gguf, ids) if gguf else None
    if by_llama is not None:
        ways["llama.cpp"] = by_llama
    rows = measure(lambda i: log_probs(ref_model, i), ways, ids)
    ref_ppl = rows.pop("reference").perplexity
    print(f"{loaded.source}: {len(ids)} texts of {acfg.data}, {rows['int8'].tokens} predicted tokens")
    print("| way | mean KL from float32 (nats a token) | perplexity | vs float32's perplexity |")
    print("|---|---|---|---|")
    print(f"| float32 dequantized | 0 | {ref_ppl:.4f} | 1.0000x |")
    for name, err in rows.items():
        print(f"| {name} | {err.kl:.6f} | {err.perplexity:.4f} | {err.perplexity / ref_ppl:.4f}x |")
    if gguf is not None:  # what model.activations=auto reads
        llama, supers_row = rows.get("llama.cpp"), rows.get("int8_256")
        record = Numerics(
            rows["int8"].kl,
            rows["int8"].perplexity,
            rows["float"].perplexity,
            None if llama is None else llama.kl,
            None if llama is None else llama.perplexity,
            None if supers_row is None else supers_row.kl,
            None if supers_row is None else supers_row.perplexity,
            per_32,
        )
        choice, why = record.choice(tiles=kernels.load().q4_int8_path() == "amx-int8")
        print(f"model.activations=auto runs {choice} on this file here: {why}")
        folder = numerics.SHIPPED if acfg.ship else cache_root() / "numerics"
        digest = numerics.file_digest(gguf, cache_root())
        print(f"(recorded in {numerics.write(folder, gguf, record, digest)})")
    if acfg.out:
        result = {"reference_perplexity": ref_ppl, **{k: vars(v) for k, v in rows.items()}}
        Path(acfg.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
