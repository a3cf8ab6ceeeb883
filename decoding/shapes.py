"""`python -m decoding.shapes NAME DIR`: a checkpoint folder of a real model's shape, without its weights.

Writes DIR/config.json for a named architecture and the embedded model's tokenizer beside it, for
`model.path=DIR model.init=random`, and DIR/prompts.jsonl (32 short prompts, so that a timing's
inputs are named: `decoding.generate prompts=DIR/prompts.jsonl`): the model is built with random
weights on the device it runs on, so the speed of a 1B or 8B model can be measured where its
weights cannot be downloaded (a GPU machine without network, docs/performance.md "On a GPU").
Random weights make N-gram drafters' acceptance meaningless; `draft.path=self` (every draft
accepted) measures the machinery. The tokenizer's 49,152 tokens cover only part of the shape's
vocabulary: ids beyond it decode to nothing, which timing does not mind.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from decoding.base.cli import fail
from decoding.base.errors import BackendError
from decoding.runtime.models import load_tokenizer
from decoding.runtime.spec import ModelSpec

_LLAMA3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "bos_token_id": 1,  # the embedded tokenizer's specials, so prompts and stops stay in its range
    "eos_token_id": 2,
}


def _rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# Meta's published configs (hidden sizes, layers, heads, rope scaling) for the shapes the papers use,
# and a tiny one for the host's share of a step.
SHAPES: dict[str, dict[str, Any]] = {
    # Not a published model: a forward of well under a millisecond, so that a step's time is the
    # host's work around it (the share a GPU would wait on), measurable on any CPU.
    "tiny": {
        **_LLAMA3,
        "vocab_size": 49152,  # the embedded tokenizer's
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_parameters": _rope(32.0),
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_parameters": _rope(8.0),
    },
}


# What the timing prompts ask about: 32 of them, one for each sequence of a 32-row batch.
TOPICS = (
    "a cat", "rain", "prime numbers", "the moon", "bread", "rivers", "volcanoes", "chess", "bees", "trains",
    "glass", "music", "maps", "winter", "salt", "clocks", "ships", "forests", "coffee", "bridges", "stars",
    "paper", "wind", "gold", "birds", "ice", "honey", "deserts", "rockets", "books", "tea", "mountains",
)  # fmt: skip


def write_prompts(path: Path) -> Path:
    """The timing prompts as `decoding.generate` reads them, one JSON row each."""
    rows = (
        {"id": f"q{i}", "prompt": f"Write a short explanation about {t}, with three facts."}
        for i, t in enumerate(TOPICS)
    )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_shape(name: str, folder: Path, tokenizer: Any | None = None) -> Path:
    """DIR with the shape's config.json, a tokenizer's files (default: the embedded model's) and the
    timing prompts. `tokenizer`: a transformers tokenizer (typed as LoadedModel.tokenizer is)."""
    from transformers import LlamaConfig

    if name not in SHAPES:
        raise BackendError(f"shape {name!r} is not one of {', '.join(SHAPES)}")
    if tokenizer is None:
        tokenizer, _ = load_tokenizer(ModelSpec())
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**SHAPES[name]).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_prompts(folder / "prompts.jsonl")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help=f"one of {', '.join(SHAPES)}")
    parser.add_argument("dir", type=Path, help="the folder to write")
    args = parser.parse_args()
    try:
        folder = write_shape(args.name, args.dir)
    except (BackendError, OSError) as e:
        fail(str(e))
    print(f"wrote {folder}: run with model.path={folder} model.init=random (prompts={folder}/prompts.jsonl)")


if __name__ == "__main__":
    main()
