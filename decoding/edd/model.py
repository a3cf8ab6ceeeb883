"""EDD, the Effective Draft Decoder (Zheng & Wang, "Faster Speculative Decoding via Effective Draft
Decoder with Pruned Candidate Tree", section 3.1): the model, saving and loading, its draft vocabulary.
The drafter that proposes trees with it is decoding/drafters/edd.py.

The target LLM is the encoder: its hidden states after one decoder layer (the fourth-to-last by
default, the paper's choice) are a soft prompt for a one-layer decoder of the target's own
architecture that shares (frozen) the target's embedding and LM head. Training (decoding/edd/train.py)
feeds a text's hidden states H and its tokens T together under the dual-block mask
(`dual_block_mask`), with block lengths drawn at random each step, and minimises KL(P_target || P_edd).

Drafting mirrors that mask: the soft prompt holds the hidden states of every committed token (the
target computes them while verifying, `Verdict.hidden`); the tokens after them (the bonus token,
then the tree) form the current block, which sees the whole soft prompt and its own tokens only.
The EDD keeps the soft prompt's keys/values in its own per-row cache, appends the newly committed
hidden states with each draft's first forward, and grows a `k_config` tree one forward per level.
The drafter only proposes: the target verifies every tree, so outputs stay the target's.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from decoding.base.errors import BackendError
from decoding.runtime.kv_cache import ForwardView, RowKVCache
from decoding.runtime.models import LoadedModel, default_cache_dir
from decoding.runtime.prepack import prepack_linears
from decoding.runtime.pretrained import pretrained
from decoding.runtime.quant import dense_state_dict
from decoding.runtime.runner import decoder_layers
from decoding.runtime.spec import ModelSpec

CONFIG_FILE = "edd_config.json"
WEIGHTS_FILE = "edd_state.pt"
log = logging.getLogger(__name__)
VOCAB_FILE = "draft_vocab.pt"  # token ids by descending frequency in the training corpus (draft.vocab)


@dataclass(frozen=True)
class EddConfig:
    target: str  # the target model it was trained for (its model.path)
    layer: int = -4  # the target decoder layer whose output is the soft prompt (-4: fourth-to-last)
    min_block: int = 2  # block lengths drawn in training; drafts whose block is longer are not made
    max_block: int = 8
    init_layer: int | None = None  # the target layer the decoder layer was copied from (None: random)

    def __post_init__(self) -> None:
        if not 1 <= self.min_block <= self.max_block:
            raise BackendError(f"EDD block lengths {self.min_block}..{self.max_block} need 1 <= min <= max")


def dual_block_mask(n: int, block_len: int) -> torch.Tensor:
    """The paper's dual-block attention mask (Figure 3a) for n tokens: [2n, 2n] bool, True = sees.

    Rows and columns 0..n-1 are the soft prompt h_0..h_{n-1} (h_p: the target's hidden state after
    reading t_0..t_p), n..2n-1 the tokens t_0..t_{n-1}. The tokens are cut into blocks of
    `block_len`, one per drafting round: a token sees the tokens of its own block up to itself and
    the hidden states of every position before its block (blocks 0..j-1), never those of its own
    block, which drafting does not have yet. The output at token t_p predicts t_{p+1} and is trained
    towards the target's distribution at p. The soft prompt itself is causal. n = 4, block_len 2:

             h0 h1 h2 h3 t0 t1 t2 t3
        h0    1  .  .  .  .  .  .  .
        h1    1  1  .  .  .  .  .  .
        h2    1  1  1  .  .  .  .  .
        h3    1  1  1  1  .  .  .  .
        t0    .  .  .  .  1  .  .  .
        t1    .  .  .  .  1  1  .  .
        t2    1  1  .  .  .  .  1  .
        t3    1  1  .  .  .  .  1  1

    (Eq. 3's P_d(t_i | t_{jL:i}, h_{<=jL}) with h indexed by the token it predicts.) Padding a
    batch to a longer n leaves every real row's visible set unchanged, so one mask serves a batch.
    """
    if n < 1 or block_len < 1:
        raise ValueError(f"dual_block_mask needs n >= 1 and block_len >= 1, got {n}, {block_len}")
    p = torch.arange(n)
    start = (p // block_len) * block_len  # where each token's block begins
    hh = p[:, None] >= p[None, :]
    th = p[None, :] < start[:, None]
    tt = (p[None, :] >= start[:, None]) & (p[None, :] <= p[:, None])
    top = torch.cat([hh, torch.zeros(n, n, dtype=torch.bool)], 1)
    return torch.cat([top, torch.cat([th, tt], 1)], 0)


def one_layer_config(config: object) -> object:
    """The target's config with one decoder layer (and no quantisation)."""
    from transformers import AutoConfig

    d = config.to_dict()  # type: ignore[attr-defined]
    d.pop("quantization_config", None)
    d["num_hidden_layers"] = 1
    if d.get("layer_types"):
        d["layer_types"] = d["layer_types"][-1:]
    return AutoConfig.for_model(**d)


class EddModel(torch.nn.Module):
    """One decoder layer (and final norm) of the target's architecture over [soft prompt; tokens].

    The embedding and LM head are the target's own modules, frozen and not registered here: the
    state dict holds only what EDD trains.
    """

    def __init__(self, config: EddConfig, target_model: torch.nn.Module) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = config
        param = next(target_model.parameters())
        lm = AutoModelForCausalLM.from_config(
            one_layer_config(target_model.config), dtype=param.dtype, attn_implementation="sdpa"
        )
        base = lm.get_decoder()
        base.embed_tokens = None  # fed inputs_embeds; the target's embedding is used instead
        self.base = base.to(param.device)
        self.lm_config = base.config
        n_layers = len(decoder_layers(target_model))
        if not -n_layers <= config.layer < n_layers:
            raise BackendError(f"EDD layer {config.layer} is outside the target's {n_layers} layers")
        target_lm = pretrained(target_model)
        target_base = target_lm.get_decoder()
        self.base.norm.load_state_dict(target_base.norm.state_dict())
        if config.init_layer is not None:
            self.base.layers[0].load_state_dict(dense_state_dict(decoder_layers(target_model)[config.init_layer]))
        # A tuple keeps the shared modules out of this module's parameters and state dict.
        self.shared = (target_lm.get_input_embeddings(), target_lm.get_output_embeddings())
        for m in self.shared:
            for p in m.parameters():
                p.requires_grad_(False)

    def vocab_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's rows (weight, bias) for the draft vocabulary `ids` (draft.vocab, FR-Spec's
        frequency-ranked draft vocabulary): on a CPU the head's weights dominate a one-layer forward,
        and reading a few thousand rows instead of the whole vocabulary makes a draft level several
        times cheaper. Lossless: the other tokens get draft probability 0, which the acceptance rules
        allow (they are never drafted, and the target's residual keeps their mass)."""
        head = self.shared[1]
        ids = ids.to(head.weight.device)
        bias = getattr(head, "bias", None)
        return head.weight[ids].contiguous(), None if bias is None else bias[ids].contiguous()

    @property
    def device(self) -> torch.device:
        weight: torch.Tensor = self.base.norm.weight  # the decoder's final norm: transformers' modules are untyped
        return weight.device

    @property
    def dtype(self) -> torch.dtype:
        weight: torch.Tensor = self.base.norm.weight
        return weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.shared[0](tokens.to(self.device))
        return embedded

    def head(self, hidden: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, or over a draft vocabulary's `vocab_rows` (in its order)."""
        if rows is None:
            logits: torch.Tensor = self.shared[1](hidden)
            return logits
        return torch.nn.functional.linear(hidden, *rows)

    def forward(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: ForwardView | None = None,
        logits_at: torch.Tensor | None = None,
        head_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Logits [B, K, V] at the columns `logits_at` (default: all) of embeds [B, T, H] (V: the
        draft vocabulary's size with `head_rows`).

        mask: additive [B or 1, 1, T, kv_len]; positions [B or 1, T].
        """
        out = self.base(
            inputs_embeds=embeds,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        hidden = out.last_hidden_state
        if logits_at is not None:
            hidden = hidden[:, logits_at.to(hidden.device)]
        return self.head(hidden, head_rows)

    def new_cache(self, batch: int, capacity: int) -> RowKVCache:
        return RowKVCache.for_model(self.lm_config, batch, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def step(
        self,
        cache: RowKVCache,
        embeds: torch.Tensor,
        tree: torch.Tensor,
        depth: torch.Tensor,
        logits_at: torch.Tensor,
        offset: int = 0,
        rows: list[int] | None = None,
        head_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """A forward over the per-row cache, as ModelRunner.forward does for the target."""
        view = cache.prepare(embeds.shape[1], offset, rows)
        mask = view.attention_mask(tree.to(self.device))
        positions = view.row_lens()[:, None] + depth.to(self.device)
        logits: torch.Tensor = self(embeds.to(self.device, self.dtype), mask, positions, view, logits_at, head_rows)
        return logits

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if "rotary" not in k}


def kl_to_target(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid positions of KL(P_target || P_draft) (the paper's Eq. 4), in nats.

    draft_logits, target_logits [B, N, V]; valid [B, N] bool.
    """
    log_q = torch.log_softmax(draft_logits.float(), -1)
    log_p = torch.log_softmax(target_logits.float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * valid).sum() / valid.sum().clamp(min=1)


# --- save / load --------------------------------------------------------------------------------


def edd_dir(target_name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the EDD of a target lives: <model cache>/edd/<target name>/."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", target_name.strip("/")) or "model"
    return root / "edd" / safe


def save_edd(
    model: EddModel, path: Path, extra: dict[str, Any] | None = None, vocab: torch.Tensor | None = None
) -> None:
    """A directory with the EDD config (JSON, with `extra`, e.g. training notes), its weights and
    `vocab` (token ids by descending corpus frequency, for draft.vocab), written to a temporary name
    and renamed so that an interrupted save leaves the old one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    meta = {"edd": asdict(model.config), "model": model.lm_config.to_dict(), **(extra or {})}
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
    torch.save({k: v.detach().cpu() for k, v in model.trained_state().items()}, tmp / WEIGHTS_FILE)
    if vocab is not None:
        torch.save(vocab.detach().cpu().long(), tmp / VOCAB_FILE)
    if path.exists():
        old = path.with_name(path.name + ".old")
        path.rename(old)
        tmp.rename(path)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(path)


def load_edd_model(path: Path, target_model: torch.nn.Module) -> EddModel:
    meta = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    config = EddConfig(**meta["edd"])
    hidden = getattr(target_model.config, "hidden_size", None)
    if meta["model"].get("hidden_size") != hidden:
        raise BackendError(
            f"the EDD in {path} was trained for a target of hidden size {meta['model'].get('hidden_size')}, "
            f"not {hidden}; train one for this model with `python -m tuning.train_edd model.path=...`"
        )
    model = EddModel(config, target_model)
    state = torch.load(Path(path) / WEIGHTS_FILE, map_location=model.device, weights_only=True)
    model.load_state_dict(state, strict=False)
    missing = set(model.trained_state()) - set(state)
    if missing:
        raise BackendError(f"{path}/{WEIGHTS_FILE} lacks {sorted(missing)[0]}; retrain with python -m tuning.train_edd")
    return model.eval()


def load_edd(spec: ModelSpec, target: LoadedModel) -> LoadedModel:
    """`draft.path=edd`: the EDD trained for the target, from the model cache."""
    name = target.name or target.source
    path = edd_dir(name, spec.cache_dir or None)
    if not (path / CONFIG_FILE).is_file():
        raise BackendError(
            f"{spec.key}.path=edd: no EDD draft decoder trained for model.path={name} (looked in {path}); "
            f"train one with `python -m tuning.train_edd model.path={name}`"
        )
    model = load_edd_model(path, target.model)
    if spec.prepack:  # frozen from here on, like the target (its LM head is the target's, prepacked with it)
        prepack_linears(model)
    return LoadedModel(model, target.tokenizer, target.device, target.use_chat_template, str(path), "edd")


@functools.lru_cache(maxsize=8)  # engines are made per call: read (and report) a ranking once
def draft_vocab(path: Path | str, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the EDD's training corpus (all it saw, if fewer)."""
    f = Path(path) / VOCAB_FILE
    if not f.is_file():
        raise BackendError(
            f"draft.vocab={size}: the EDD in {path} has no token ranking ({VOCAB_FILE}); rerun "
            "`python -m tuning.train_edd` (it reuses its corpus and checkpoint) to write it, or set draft.vocab=null"
        )
    ranking: torch.Tensor = torch.load(f, weights_only=True)  # saved by save_edd: a tensor
    if size > len(ranking):
        log.info("draft.vocab=%d: the EDD's corpus has %d distinct tokens; drafting over those", size, len(ranking))
    return ranking[:size]


def vocab_ranking(texts: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Token ids seen in `texts`, most frequent first (ties: smaller id first)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in texts:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)  # stable: ties keep id order
    return order[counts[order] > 0]
