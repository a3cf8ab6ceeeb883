"""A forward padded to a few fixed shapes, so that a GPU can replay it from a CUDA graph.

On a GPU a forward of the 8B shape launches ~600 kernels; issued one by one from Python they took
23 ms where the GPU's own work is ~5 ms (docs/performance.md, "On a GPU"). Captured once as a CUDA
graph and replayed, the launches cost one call. A graph fixes every shape and address, so:

- a forward's rows and tokens are padded up to a bucket (`Buckets.rows` x `Buckets.tokens`), and
  the positions it attends over up to a multiple of `Buckets.context`; shapes past the largest
  bucket run the same code eagerly;
- its inputs (tokens, positions, where each token's key/value goes, which cache rows each row
  reads, the visibility mask) are copied from the host into buffers the graph owns, with no wait;
- padded tokens write their keys/values into the cache's spare row (`RowKVCache.spare`), which no
  real row reads, and see only column 0: their outputs are never read either.

The forward is `LlamaModel.forward`'s, op for op on the model's own modules, with the keys/values
written at the given (row, slot) pairs and, under sdpa, a KV head's query heads folded into its rows
(no copy of the context per layer): every logit of a real token is what the unpadded forward
computes, on the CPU to the bit (its kernels do not depend on the batch) and on a GPU up to the
kernels the shapes select. The LM head runs after the graph on the rows and tokens
whose logits are wanted. On a CPU the same path runs eagerly (`model.cuda_graphs=eager`) so the
tests check the padding, buckets and masks there; the CPU product path stays ragged (llama.py).
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from decoding.base.errors import BackendError, ConfigError
from decoding.runtime import architectures, attention
from decoding.runtime.kv_cache import KVCache, RowKVCache, to_device
from decoding.runtime.pretrained import decoder, pretrained
from decoding.runtime.spec import GRAPH_CHOICES, Buckets

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

log = logging.getLogger(__name__)


@functools.cache
def _hf_attention() -> tuple[Any, Any, Any]:
    """transformers' rotary embedding, eager attention and attention registry, imported on first use:
    their modules cost seconds to import, which every command paid before it parsed its arguments."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    return apply_rotary_pos_emb, eager_attention_forward, ALL_ATTENTION_FUNCTIONS


@dataclass(frozen=True)
class StaticSpec:
    """How a model's forwards run: bucketed, and captured as CUDA graphs or eager."""

    buckets: Buckets
    capture: bool


def resolve_graphs(choice: str, device: torch.device, buckets: Buckets, key: str = "model") -> StaticSpec | None:
    """on: bucketed forwards replayed from CUDA graphs (CUDA only; a graph that does not fit in
    memory is an error); auto: the same on CUDA, a graph that does not fit running eagerly, and the
    unpadded forward elsewhere (a CPU's launches cost little next to its arithmetic); eager: the
    bucketed forward without capture (any device); off: the unpadded forward."""
    if choice not in GRAPH_CHOICES:
        raise ConfigError(f"{key}.cuda_graphs={choice!r} is not one of {', '.join(GRAPH_CHOICES)}")
    if choice == "on" and device.type != "cuda":
        raise ConfigError(
            f"{key}.cuda_graphs=on needs a CUDA device, not {device}; use {key}.cuda_graphs=auto "
            f"(or eager for the same bucketed forward without capture)"
        )
    if choice == "off" or (choice == "auto" and device.type != "cuda"):
        return None
    return StaticSpec(buckets, capture=choice != "eager")


@dataclass
class _Inputs:
    """One bucket's input buffers (on the model's device; the graph reads them at these addresses)."""

    tokens: torch.Tensor  # [B, T] token ids (pads: 0)
    positions: torch.Tensor  # [B, T] rotary positions (pads: 0)
    write_rows: torch.Tensor  # [B, T] the cache row each token's key/value goes to (pads: the spare row)
    write_slots: torch.Tensor  # [B, T] its position in that row
    kv_rows: torch.Tensor  # [B] the cache row each row attends over (pad rows: the spare row)
    mask: torch.Tensor  # [B, T, L] boolean, True: visible

    def fill(self, host: _Inputs) -> None:
        for name in ("tokens", "positions", "write_rows", "write_slots", "kv_rows", "mask"):
            getattr(self, name).copy_(getattr(host, name), non_blocking=True)

    def to(self, device: torch.device) -> _Inputs:
        return _Inputs(*(to_device(getattr(self, n), device) for n in self.__dataclass_fields__))


@dataclass
class _Graph:
    inputs: _Inputs
    out: torch.Tensor  # [B, T, H] final normed hidden states
    graph: torch.cuda.CUDAGraph


@dataclass
class _Writes:
    """The cache as a layer's attention sees it: `update` stores the new keys/values at the given
    (row, slot) pairs and returns what the forward's rows attend over."""

    cache: KVCache
    inputs: _Inputs
    positions: int  # L
    # How the forward's rows are found in the cache: "in_place" (the attention reads the rows
    # `kv_rows` names itself), "sliced" (they are its first rows, in order) or "gathered".
    reads: str

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        k, v = self.cache.keys[layer], self.cache.values[layer]
        rows, slots = self.inputs.write_rows, self.inputs.write_slots
        k[rows, :, slots] = key_states.transpose(1, 2).to(k.dtype)  # [B, T, H, D] at (row, slot) pairs
        v[rows, :, slots] = value_states.transpose(1, 2).to(v.dtype)
        k, v = k[:, :, : self.positions], v[:, :, : self.positions]
        if self.reads == "in_place":
            return k, v
        if self.reads == "sliced":  # a view: no copy of the context
            n = self.inputs.kv_rows.shape[0]
            return k[:n], v[:n]
        return k.index_select(0, self.inputs.kv_rows), v.index_select(0, self.inputs.kv_rows)


@dataclass
class GraphStats:
    """What capture cost so far: graphs captured and the seconds it took (reported at load and in
    the profile), and the forwards that ran from a graph, eagerly in a bucket, or past the buckets."""

    captured: int = 0
    capture_s: float = 0.0
    replayed: int = 0
    eager: int = 0
    unbucketed: int = 0


@dataclass
class StaticForward:
    """A causal LM's forward over a RowKVCache with a spare row, in padded buckets (see the module)."""

    model: torch.nn.Module
    spec: StaticSpec
    strict: bool = False  # model.cuda_graphs=on: graphs that do not fit in memory are an error, not a fallback
    stats: GraphStats = field(default_factory=GraphStats)

    @staticmethod
    def computes(model: torch.nn.Module) -> bool:
        """Whether the bucketed forward computes this model: a causal LM of an architecture in the table."""
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "rotary_emb", "layers", "norm")
        return not (
            inner is None
            or any(not hasattr(inner, p) for p in parts)
            or pretrained(model).get_output_embeddings() is None
            or (arch := architectures.of(model)) is None
            or any(type(layer) is not arch.decoder_layer for layer in inner.layers)
        )

    @classmethod
    def of(cls, model: torch.nn.Module, spec: StaticSpec, strict: bool = False) -> StaticForward:
        if not cls.computes(model):
            raise BackendError(
                f"model.cuda_graphs: {type(model).__name__} is not a causal LM of an architecture the bucketed "
                f"forward computes ({architectures.names()}); set model.cuda_graphs=off"
            )
        return cls(model, spec, strict)

    @property
    def in_place(self) -> bool:
        impl: str = pretrained(self.model).config._attn_implementation
        return impl == attention.NAME

    def hidden(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        tree: torch.Tensor,
        depth: torch.Tensor,
        offset: int = 0,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, H] of new tokens [B, T] (see ModelRunner.forward for `tree`,
        `depth`, `offset` and `rows`); their keys/values are written into the cache as usual."""
        lens = cache.lens if rows is None else cache.lens[rows]
        batch, n_new = tokens.shape
        kv_len = int(lens.max()) + offset + n_new
        if kv_len > cache.capacity:
            raise RuntimeError(f"KV cache holds {cache.capacity} positions, a forward needs {kv_len}")
        row_ids = torch.arange(cache.batch) if rows is None else torch.tensor(rows, dtype=torch.long)
        shape = self.spec.buckets.fit(batch, n_new, kv_len, cache.capacity)
        if self.spec.capture and cache.graphs is None:
            shape = None  # a cache nobody captures for: padding would only cost
        if shape is None:  # past the largest bucket: the same layers at the forward's own shape
            self.stats.unbucketed += 1
            host = _host_inputs(cache, tokens, tree, depth, offset, lens, row_ids, (batch, n_new, kv_len))
            return self._forward(cache, host.to(cache.device), kv_len, self._reads(row_ids, batch, cache))
        host = _host_inputs(cache, tokens, tree, depth, offset, lens, row_ids, shape)
        reads = self._reads(row_ids, shape[0], cache)
        graph = self._graph(cache, shape, host, reads) if self.spec.capture else None
        if graph is None:
            self.stats.eager += 1
            return self._forward(cache, host.to(cache.device), shape[2], reads)[:batch, :n_new]
        graph.inputs.fill(host)
        graph.graph.replay()
        self.stats.replayed += 1
        return graph.out[:batch, :n_new]

    def _reads(self, row_ids: torch.Tensor, bucket_rows: int, cache: KVCache) -> str:
        """How the attention finds the forward's rows (see `_Writes.reads`): a slice where they are the
        cache's first rows in order (a bucket's pad rows then read the rows after them, or the spare
        row, and their outputs are dropped), else a gather."""
        if self.in_place:
            return "in_place"
        first = torch.equal(row_ids, torch.arange(len(row_ids)))
        return "sliced" if first and bucket_rows <= cache.batch + cache.spare else "gathered"

    def _forward(self, cache: KVCache, inputs: _Inputs, positions: int, reads: str) -> torch.Tensor:
        """The Llama forward `LlamaModel.forward` computes, op for op but for the attention's form (see
        `_attend`), over the cache through `_Writes`."""
        inner = decoder(self.model)
        rotary = _hf_attention()[0]
        h = inner.embed_tokens(inputs.tokens)
        cos, sin = inner.rotary_emb(h, inputs.positions)
        writes = _Writes(cache, inputs, positions, reads)
        mask = self._mask(inputs, h)
        for layer in inner.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (*x.shape[:-1], -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = rotary(q, k, cos, sin)
            keys, values = writes.update(k, v, attn.layer_idx)
            out = self._attend(attn, q, keys, values, mask, inputs.kv_rows)
            h = h + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        normed: torch.Tensor = inner.norm(h)
        return normed

    def _mask(self, inputs: _Inputs, h: torch.Tensor) -> torch.Tensor:
        """The forward's mask in the form its attention takes, made once for all layers: for sdpa
        [B, 1, G * T, L] (each of a KV head's G query heads a block of T rows), else [B, 1, T, L]
        (additive for eager attention)."""
        mask = inputs.mask[:, None]
        config = pretrained(self.model).config
        impl = config._attn_implementation
        if impl == "sdpa":
            groups = config.num_attention_heads // config.num_key_value_heads
            b, _, t, width = mask.shape
            return mask[:, :, None].expand(b, 1, groups, t, width).reshape(b, 1, groups * t, width)
        if impl == "eager":
            return torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(~mask, torch.finfo(h.dtype).min)
        return mask

    def _attend(
        self,
        module: torch.nn.Module,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        kv_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Attention output [B, T, H, D] of queries [B, H, T, D]. With sdpa the G query heads of a KV
        head are folded into its rows (transformers does this for one token, and repeats the keys
        G times for more: a copy of the context per layer that the fold avoids)."""
        impl = pretrained(self.model).config._attn_implementation
        scaling = cast(float, module.scaling)  # the attention module's float (head_dim ** -0.5)
        if impl != "sdpa":
            extra = {"kv_rows": kv_rows} if self.in_place else {}
            _, eager, registry = _hf_attention()
            fn = registry.get_interface(impl, eager)
            attended: torch.Tensor = fn(module, q, k, v, mask, dropout=0.0, scaling=scaling, **extra)[0]
            return attended
        b, heads, t, d = q.shape
        kv_heads = k.shape[1]
        folded = q.reshape(b, kv_heads, heads // kv_heads * t, d)
        out = torch.nn.functional.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scaling)
        # (reshape: CUDA's sdpa kernels return a [B, T, H, D] layout transposed, which no view unfolds)
        return out.reshape(b, heads, t, d).transpose(1, 2)

    def _graph(self, cache: KVCache, shape: tuple[int, int, int], host: _Inputs, reads: str) -> _Graph | None:
        """The bucket's graph over this cache, captured now if it is new (None: it does not fit in
        memory and the user left graphs at auto: that bucket runs eagerly from now on)."""
        assert cache.graphs is not None
        key = (id(self), *shape, reads)
        if key in cache.graphs:
            return cast(_Graph, cache.graphs[key])  # (its bucket keys hold graphs; "pool" keys hold pools)
        t0 = time.perf_counter()
        inputs = host.to(cache.device)
        try:
            graph = self._capture(cache, inputs, shape[2], reads)
        except torch.OutOfMemoryError as e:
            if self.strict:
                raise BackendError(
                    f"the CUDA graph of {shape[0]} rows x {shape[1]} tokens does not fit in GPU memory; lower "
                    "model.graph_rows / model.graph_tokens, or set model.cuda_graphs=auto to run it eagerly"
                ) from e
            log.warning("a CUDA graph of %d rows x %d tokens does not fit in GPU memory: run eagerly", *shape[:2])
            self.spec = StaticSpec(self.spec.buckets, capture=False)
            return None
        cache.graphs[key] = graph
        self.stats.captured += 1
        self.stats.capture_s += time.perf_counter() - t0
        return graph

    def _capture(self, cache: KVCache, inputs: _Inputs, positions: int, reads: str) -> _Graph:
        # A warm-up on a side stream first (cuBLAS workspaces, lazy kernel loads), as torch's capture
        # needs; it runs the step's real inputs, so its cache writes are the ones the replay makes.
        stream = torch.cuda.Stream(cache.device)
        stream.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(stream):
            self._forward(cache, inputs, positions, reads)
        torch.cuda.current_stream(cache.device).wait_stream(stream)
        # One pool for this cache's buckets (one replays at a time), living exactly as long as they do:
        # once a resize drops them the allocator may release the pool, and a capture into its stale
        # handle fails an allocator assert and leaves the CUDA generator mid-capture for the process.
        graphs = cache.graphs
        assert graphs is not None, "only a cache that graphs are captured over (`_graph`) gets here"
        pool = cast("_POOL_HANDLE | None", graphs.get(("pool", id(self))))
        if pool is None:
            pool = graphs[("pool", id(self))] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No collection while capturing: a dead engine's graphs freed then would release their
        # memory into the pool being captured into (torch collects once before it starts).
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: a drafting thread (SEED's rounds) may launch its own work meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(cache, inputs, positions, reads)
        finally:
            if collecting:
                gc.enable()
        return _Graph(inputs, out, graph)


def _host_inputs(
    cache: KVCache,
    tokens: torch.Tensor,
    tree: torch.Tensor,
    depth: torch.Tensor,
    offset: int,
    lens: torch.Tensor,
    row_ids: torch.Tensor,
    shape: tuple[int, int, int],
) -> _Inputs:
    """A forward's inputs padded to `shape` (rows, tokens, positions), built on the host."""
    # Pads write to the spare row: rows of their own (the runner gives the bucketed forward no paged cache).
    assert isinstance(cache, RowKVCache), f"the bucketed forward needs a RowKVCache, not {type(cache).__name__}"
    batch, n_new = tokens.shape
    b, t, width = shape
    spare = cache.spare_row
    out_tokens = torch.zeros(b, t, dtype=torch.long)
    out_tokens[:batch, :n_new] = tokens.cpu()
    positions = torch.zeros(b, t, dtype=torch.long)
    positions[:batch, :n_new] = lens[:, None] + depth.cpu()
    write_rows = torch.full((b, t), spare, dtype=torch.long)
    write_rows[:batch, :n_new] = row_ids[:, None]
    # Pads go to distinct slots of the spare row where they fit: they are never read, so it is only
    # for tidiness that two pads rarely land on one slot.
    write_slots = torch.arange(t).clamp(max=cache.capacity - 1).expand(b, t).clone()
    write_slots[:batch, :n_new] = lens[:, None] + offset + torch.arange(n_new)
    kv_rows = torch.full((b,), spare, dtype=torch.long)
    kv_rows[:batch] = row_ids
    mask = torch.zeros(b, t, width, dtype=torch.bool)
    mask[:, :, 0] = True  # pads see one column: a softmax over nothing would be NaN
    cols = torch.arange(width)
    committed = cols[None, None, :] < lens[:, None, None]
    real = committed.expand(batch, n_new, width).clone()
    span = lens[:, None] + torch.arange(offset + n_new)
    real.scatter_(2, span[:, None, :].expand(batch, n_new, -1), tree.cpu().to(torch.bool))
    mask[:batch, :n_new] = real
    return _Inputs(out_tokens, positions, write_rows, write_slots, kv_rows, mask)
