"""EDD, the Effective Draft Decoder (Zheng & Wang, "Faster Speculative Decoding via Effective Draft
Decoder with Pruned Candidate Tree", section 3.1), and the drafter that proposes trees with it.

The target LLM is the encoder: its hidden states after one decoder layer (the fourth-to-last by
default, the paper's choice) are a soft prompt for a one-layer decoder of the target's own
architecture that shares (frozen) the target's embedding and LM head. Training (decoding/train_edd.py)
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
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from decoding.draft_model import SpecOptions, make_policy
from decoding.draft_tree import DraftTree
from decoding.errors import BackendError
from decoding.kv_cache import RowKVCache, cache_geometry
from decoding.models import LoadedModel, ModelSpec, default_cache_dir
from decoding.prepack import prepack_linears
from decoding.sampling import SamplingParams, process_logits
from decoding.sequence import Sequence
from decoding.target import Target, decoder_layers
from decoding.tree_policy import grow_levels
from decoding.verify import Verdict

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
        target_base = target_model.get_decoder()
        self.base.norm.load_state_dict(target_base.norm.state_dict())
        if config.init_layer is not None:
            self.base.layers[0].load_state_dict(decoder_layers(target_model)[config.init_layer].state_dict())
        # A tuple keeps the shared modules out of this module's parameters and state dict.
        self.shared = (target_model.get_input_embeddings(), target_model.get_output_embeddings())
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
        return self.base.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.norm.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.shared[0](tokens.to(self.device))

    def head(self, hidden: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, or over a draft vocabulary's `vocab_rows` (in its order)."""
        if rows is None:
            return self.shared[1](hidden)
        return torch.nn.functional.linear(hidden, *rows)

    def forward(
        self,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: RowKVCache | None = None,
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
        n_layers, n_kv, head_dim = cache_geometry(self.lm_config)
        return RowKVCache(n_layers, batch, n_kv, head_dim, capacity, self.dtype, self.device)

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
        """A forward over the per-row cache, as Target.forward does for the target."""
        cache.prepare(embeds.shape[1], offset, rows)
        mask = cache.attention_mask(tree.to(self.device), self.dtype)
        positions = cache.row_lens()[:, None] + depth.to(self.device)
        return self(embeds.to(self.device, self.dtype), mask, positions, cache, logits_at, head_rows)

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


def save_edd(model: EddModel, path: Path, extra: dict | None = None, vocab: torch.Tensor | None = None) -> None:
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
            f"not {hidden}; train one for this model with `python -m decoding.train_edd model.path=...`"
        )
    model = EddModel(config, target_model)
    state = torch.load(Path(path) / WEIGHTS_FILE, map_location=model.device, weights_only=True)
    model.load_state_dict(state, strict=False)
    missing = set(model.trained_state()) - set(state)
    if missing:
        raise BackendError(
            f"{path}/{WEIGHTS_FILE} lacks {sorted(missing)[0]}; retrain with python -m decoding.train_edd"
        )
    return model.eval()


def load_edd(spec: ModelSpec, target: LoadedModel) -> LoadedModel:
    """`draft.path=edd`: the EDD trained for the target, from the model cache."""
    name = target.name or target.source
    path = edd_dir(name, spec.cache_dir or None)
    if not (path / CONFIG_FILE).is_file():
        raise BackendError(
            f"{spec.key}.path=edd: no EDD draft decoder trained for model.path={name} (looked in {path}); "
            f"train one with `python -m decoding.train_edd model.path={name}`"
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
            "`python -m decoding.train_edd` (it reuses its corpus and checkpoint) to write it, or set draft.vocab=null"
        )
    ranking = torch.load(f, weights_only=True)
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


# --- drafting -----------------------------------------------------------------------------------


class EddDrafter:
    """Drafts trees with an EDD from the target's hidden states of the committed tokens; the tree's
    shape is the tree policy of `options` (decoding/tree_policy.py: k_config, sequoia or pct).

    Per row: `known` tokens of the context have hidden states (the target's cache length); those
    not yet fed to the EDD wait in `queue`; the rest of the context (the bonus token, or on the first
    round the prompt's tail the target has not read) is the current block. A row whose block is
    longer than the EDD was trained on, or has no room left, gets an empty tree this round.
    """

    def __init__(self, edd: EddModel, target: Target, options: SpecOptions, vocab: torch.Tensor | None = None) -> None:
        self.edd = edd
        self.target = target
        # draft.vocab: the corpus's most frequent tokens, to which each call adds its prompts' tokens and
        # every token committed since (None: the whole vocabulary); `head_rows` are the head's rows for it.
        self.base_vocab = vocab
        self.vocab_set: set[int] = set() if vocab is None else set(vocab.tolist())
        self.vocab = vocab
        self.head_rows = None if vocab is None else edd.vocab_rows(vocab)
        if options.tree_policy == "pct" and options.pct_ratio is None:
            options = replace(options, pct_ratio=self._measure_ratio())
        self.policy = make_policy(options, target, target)
        self.max_nodes = self.policy.max_nodes
        self.vocab_size = int(edd.shared[1].weight.shape[0])
        target.capture_hidden(edd.config.layer)
        self.seqs: list[Sequence] = []
        self.known: dict[int, int] = {}
        self.queue: dict[int, list[torch.Tensor]] = {}
        self.position: dict[int, int] = {}

    def _measure_ratio(self, context: int = 64, repeats: int = 5) -> float:
        """PCT's s_d / s_t here: one EDD forward (one token after a soft prompt of `context`) against
        one target verification forward of one token, medians of `repeats`."""
        from decoding.profile import time_forward

        cache = self.edd.new_cache(1, context + 2)
        size = self.edd.lm_config.hidden_size
        prompt = torch.zeros(1, context, size)
        causal = torch.ones(context, context, dtype=torch.bool).tril()[None]
        self.edd.step(cache, prompt, causal, torch.arange(context)[None], torch.zeros(0, dtype=torch.long))
        cache.advance(torch.tensor([context]))
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            self.edd.step(
                cache,
                self.edd.embed(torch.tensor([[7]])),
                torch.ones(1, 1, 1, dtype=torch.bool),
                torch.zeros(1, 1, dtype=torch.long),
                torch.tensor([0]),
                head_rows=self.head_rows,
            )
            if i:
                times.append(time.perf_counter() - t0)
        s_d = 1000 * statistics.median(times)
        s_t = statistics.median(time_forward(self.target, context, 1, 1, repeats))
        return s_d / s_t

    def start(self, seqs: list[Sequence], capacity: int) -> None:
        self.seqs = seqs
        if self.base_vocab is not None:
            self.vocab_set, self.vocab = set(self.base_vocab.tolist()), None
            self._extend_vocab(t for s in seqs for t in s.prompt)
        head = self.target.start_hidden
        n = 0 if head is None else len(head)
        # The soft prompt (<= capacity) plus one draft's uncommitted slots: pads, queue, block, tree.
        room = 2 * capacity + self.edd.config.max_block + self.max_nodes
        if n:
            self.cache = self.edd.new_cache(1, room)
            causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
            self.edd.step(self.cache, head[None], causal, torch.arange(n)[None], torch.zeros(0, dtype=torch.long))
            self.cache.advance(torch.tensor([n]))
            self.cache.select_rows(torch.zeros(len(seqs), dtype=torch.long))
        else:
            self.cache = self.edd.new_cache(len(seqs), room)
        self.known = dict.fromkeys(range(len(seqs)), n)
        self.queue = {i: [] for i in range(len(seqs))}
        self.position = {i: i for i in range(len(seqs))}

    def _extend_vocab(self, tokens: Iterable[int]) -> None:
        """Add `tokens` to the draft vocabulary (and the head's rows for it) if any are new."""
        new = set(tokens) - self.vocab_set
        if new or self.vocab is None:
            self.vocab_set |= new
            self.vocab = torch.tensor(sorted(self.vocab_set), dtype=torch.long)
            self.head_rows = self.edd.vocab_rows(self.vocab)

    def draft(self, rows: list[int]) -> list[DraftTree]:
        trees = [DraftTree() for _ in rows]
        active = []
        for b, i in enumerate(rows):
            seq = self.seqs[i]
            block = (seq.prompt + seq.generated)[self.known[i] :]
            if self.base_vocab is not None:
                self._extend_vocab(block)  # the tokens committed since the last draft
            # A step commits at most the accepted path plus one token (as ModelDrafter).
            room = seq.rule.max_new_tokens - len(seq.generated) - 1
            if room >= 1 and 1 <= len(block) <= self.edd.config.max_block:
                active.append((b, i, block, room))
        if active:
            for (b, _, _, _), tree in zip(active, self._grow(active)):
                trees[b] = tree
        return trees

    @torch.inference_mode()
    def _grow(self, active: list[tuple[int, int, list[int], int]]) -> list[DraftTree]:
        edd = self.edd
        batch = len(active)
        queued = [torch.cat(self.queue[i]) if self.queue[i] else None for _, i, _, _ in active]
        k = [0 if q is None else len(q) for q in queued]
        width = max(kb + len(block) for kb, (_, _, block, _) in zip(k, active))
        embeds = torch.zeros(batch, width, edd.lm_config.hidden_size, dtype=edd.dtype, device=edd.device)
        see = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
        depth = torch.zeros(batch, width, dtype=torch.long)
        pads = []
        for b, ((_, _, block, _), q) in enumerate(zip(active, queued)):
            # [pad, queued hidden states, block tokens]: one causal run (the block sees every
            # hidden state before it, the soft prompt stays causal).
            pad = width - k[b] - len(block)
            pads.append(pad)
            if q is not None:
                embeds[b, pad : pad + k[b]] = q.to(edd.device, edd.dtype)
            embeds[b, pad + k[b] :] = edd.embed(torch.tensor(block))
            see[b, pad:, pad:] = torch.ones(width - pad, width - pad, dtype=torch.bool).tril()
            depth[b, pad:] = torch.arange(width - pad)
        positions = [self.position[i] for _, i, _, _ in active]
        cache_rows = None if positions == list(range(self.cache.batch)) else positions
        logits = edd.step(
            self.cache, embeds, see, depth, torch.tensor([width - 1]), rows=cache_rows, head_rows=self.head_rows
        )
        seqs = [self.seqs[i] for _, i, _, _ in active]
        growths = [self.policy.grow(s.params.greedy, s.draft_generator, room) for s, (*_, room) in zip(seqs, active)]

        def level(tokens: torch.Tensor, see: torch.Tensor, depth: torch.Tensor, offset: int) -> torch.Tensor:
            every = torch.arange(tokens.shape[1])
            return edd.step(self.cache, edd.embed(tokens), see, depth, every, offset, cache_rows, self.head_rows)

        # Tree nodes belong to the block: they see its columns (the queue's too) and their ancestors.
        grow_levels(
            growths,
            logits,
            lambda b, lg: _dists(lg, seqs[b].params, self.vocab, self.vocab_size),
            level,
            [range(pads[b], width) for b in range(batch)],
            [width - pads[b] for b in range(batch)],
            width,
        )
        # The queued hidden states join the soft prompt; the block and the tree never do.
        for b, (_, i, _, _) in enumerate(active):
            if k[b]:
                self.cache.keep(self.position[i], list(range(pads[b], pads[b] + k[b])))
            self.queue[i] = []
        return [g.tree for g in growths]

    def update(self, rows: list[int], verdicts: list[Verdict]) -> None:
        for i, v in zip(rows, verdicts):
            if self.seqs[i].done:
                continue
            if v.hidden is None:
                raise BackendError("the EDD drafter needs the target's hidden states (Target.capture_hidden)")
            self.queue[i].append(v.hidden)
            self.known[i] += len(v.hidden)

    def retain(self, rows: list[int]) -> None:
        """Drop every other row from the EDD cache."""
        order = sorted(rows, key=self.position.__getitem__)
        self.cache.select_rows(torch.tensor([self.position[i] for i in order], dtype=torch.long))
        self.position = {i: pos for pos, i in enumerate(order)}


def _dists(
    logits: torch.Tensor, params: SamplingParams, ids: torch.Tensor | None, vocab_size: int
) -> list[torch.Tensor]:
    """Draft distributions [V] on the CPU for logits [n, V] (or [n, len(ids)] over the draft
    vocabulary `ids`, the rest of the vocabulary at -inf: probability 0): the plain softmax at
    temperature 0 (for ranking and confidences), above it the processed distribution the draws follow."""
    if ids is not None:
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        logits = full.index_copy_(1, ids.to(logits.device), logits)
    q = logits.float().softmax(-1) if params.greedy else process_logits(logits[None], [params])[0]
    return list(q.cpu().unbind(0))
