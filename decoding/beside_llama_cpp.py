"""`python -m decoding.beside_llama_cpp`: this project's prompt and decode rates beside llama.cpp's on
the same GGUF file, in one process, alternated (Hydra).

Two measurements, each repeated and alternated between the two (the project first on odd repeats),
medians printed with the ratio:

- **prompt**: `prompt_tokens` tokens of held text (GSM8K test questions and solutions) computed into
  an empty cache: the project's forward as a sequence's admission runs it (one ModelRunner forward of
  the whole prompt), llama.cpp's `eval` (one batch: its n_batch is at least the prompt).
- **decode**: one greedy sequence of up to `new_tokens` tokens after the first question (chat
  formatted): `decoder` (default `ar`) through the Engine, llama.cpp's own generate loop; tokens a
  second over the whole call, prompt included, each side's own token count (EOS may stop either).

Needs llama-cpp-python (`make setup` installs it); its threads are torch's (OMP_NUM_THREADS).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.api.config import DecoderConfig
from decoding.api.engine import Engine
from decoding.base.cli import fail, hydra_command
from decoding.base.errors import BackendError, ConfigError
from decoding.base.options import as_int, held_rows, held_text
from decoding.base.values import GenRequest
from decoding.runtime.models import gguf_file, load_model
from decoding.runtime.packing import pack
from decoding.runtime.runner import ModelRunner
from decoding.runtime.spec import ModelSpec
from decoding.speculation.draft_tree import DraftTree

if TYPE_CHECKING:
    from llama_cpp import Llama


@dataclass(frozen=True)
class BesideConfig:
    model: ModelSpec
    decoder: str
    data: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    out: str | None

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig) -> BesideConfig:
        c = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # a DictConfig's is a dict
        data = held_text("data", c["data"])
        counts = {k: as_int(k, c[k]) for k in ("prompt_tokens", "new_tokens", "repeats")}
        for key, value in counts.items():
            if value < 1:
                raise ConfigError(f"{key}={value} must be a positive integer")
        return cls(ModelSpec.from_config(c["model"]), str(c["decoder"]), data, **counts, out=c.get("out"))


def prompt_ids(tokenize: Callable[[str], list[int]], rows: list[dict[str, Any]], n: int) -> list[int]:
    """The first `n` tokens of the held texts (question, then solution) one after another."""
    ids: list[int] = []
    for row in rows:
        ids += tokenize(f"{row['question']}\n{row['answer']}\n")
        if len(ids) >= n:
            return ids[:n]
    raise ConfigError(f"prompt_tokens={n}: the held texts have only {len(ids)} tokens")


def project_prompt_s(runner: ModelRunner, ids: list[int]) -> float:
    """Seconds to compute `ids` into a fresh cache row: one forward of the whole prompt, the LM head on
    its last token only (as the engine's prefill and llama.cpp's `eval` compute it)."""
    cache = runner.new_cache(1, len(ids) + 1)
    packed = pack([ids], [DraftTree()])
    t0 = time.perf_counter()
    runner.forward(cache, packed.tokens, packed.see, packed.depth, logits_at=torch.tensor([len(ids) - 1]))
    return time.perf_counter() - t0


def project_decode(engine: Engine, prompt: str, new_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of one greedy sequence through the engine's decoder."""
    t0 = time.perf_counter()
    (result,) = engine.generate([GenRequest(prompt, max_new_tokens=new_tokens)])
    return len(result.token_ids), time.perf_counter() - t0


def llama_prompt_s(llm: Llama, ids: list[int]) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return time.perf_counter() - t0


def llama_decode(llm: Llama, ids: list[int], new_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of llama.cpp's greedy generate loop from `ids`, stopping at EOS or `new_tokens`."""
    llm.reset()
    n, t0 = 0, time.perf_counter()
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if token == llm.token_eos():
            break
        n += 1
        if n >= new_tokens:
            break
    return n, time.perf_counter() - t0


def rate_row(name: str, ours: list[float], theirs: list[float], unit: str) -> str:
    a, b = statistics.median(ours), statistics.median(theirs)
    runs: Callable[[list[float]], str] = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    return f"| {name} | {a:.1f} {unit} ({runs(ours)}) | {b:.1f} {unit} ({runs(theirs)}) | {a / b:.2f}x |"


@hydra_command("beside_llama_cpp", groups=("model",))
def main(cfg: DictConfig) -> None:
    try:
        bcfg = BesideConfig.from_omegaconf(cfg)
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise BackendError(f"llama-cpp-python is not installed ({e}); run `make setup`") from None
        gguf = gguf_file(bcfg.model)
        if gguf is None:
            raise ConfigError(f"model.path={bcfg.model.path} is not a GGUF file; llama.cpp runs GGUF files")
        loaded = load_model(bcfg.model)
        engine = Engine(loaded, DecoderConfig(bcfg.decoder))
        rows = held_rows(bcfg.data)
        tokenize = lambda text: loaded.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        ids = prompt_ids(tokenize, rows, bcfg.prompt_tokens)
    except (ConfigError, BackendError) as e:
        fail(str(e).splitlines()[0])
    question = rows[0]["question"]
    chat_ids = engine.encode(question)
    llm = Llama(
        model_path=str(gguf),
        n_ctx=len(chat_ids) + bcfg.new_tokens + len(ids) + 16,
        n_batch=max(512, len(ids)),
        n_threads=torch.get_num_threads(),
        verbose=False,
    )
    runner = engine.target
    project_prompt_s(runner, ids[:8]), llama_prompt_s(llm, ids[:8])  # warm-up
    project_decode(engine, question, 4), llama_decode(llm, chat_ids, 4)
    prompt: dict[str, list[float]] = {"project": [], "llama.cpp": []}
    decode: dict[str, list[float]] = {"project": [], "llama.cpp": []}
    tokens: dict[str, list[int]] = {"project": [], "llama.cpp": []}
    for r in range(bcfg.repeats):
        for side in ("project", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "project"):
            if side == "project":
                s = project_prompt_s(runner, ids)
                n, d = project_decode(engine, question, bcfg.new_tokens)
            else:
                s = llama_prompt_s(llm, ids)
                n, d = llama_decode(llm, chat_ids, bcfg.new_tokens)
            prompt[side].append(len(ids) / s)
            decode[side].append(n / d)
            tokens[side].append(n)
    print(
        f"{loaded.source} ({gguf.name}) on {loaded.device}, {torch.get_num_threads()} threads, decoder={bcfg.decoder}, "
        f"medians of {bcfg.repeats} alternated repeats"
    )
    print("| measure | this project | llama.cpp | ratio |\n|---|---|---|---|")
    print(rate_row(f"{len(ids)} prompt tokens", prompt["project"], prompt["llama.cpp"], "tok/s"))
    print(rate_row("one greedy sequence", decode["project"], decode["llama.cpp"], "tok/s"))
    print(f"tokens generated: this project {tokens['project']}, llama.cpp {tokens['llama.cpp']}")
    if bcfg.out:
        result = {
            "prompt_tokens_per_s": prompt,
            "decode_tokens_per_s": decode,
            "tokens": tokens,
            "source": loaded.source,
        }
        Path(bcfg.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
