"""GGUF weights in their own 4-bit format, through torch's int4 group-wise CPU kernel.

A GGUF file's 4-bit tensors (Q4_0, Q4_1, Q4_K) store, per group of 32 weights along the input
dimension, a 4-bit code q in 0..15 and a scale and minimum with w = scale * q + minimum (Q4_0:
minimum = -8 scale; Q4_K: scale and minimum are 6-bit multiples of the super-block's two fp16
factors). torch's kernel (`_weight_int4pack_mm_for_cpu`, group 32) computes with (q - 8) * s + z,
so s = scale and z = minimum + 8 scale. What is rounded: s and z are stored in bfloat16 (8
significant bits; GGUF's fp16 scales have 11), z after an exact-or-float32 sum; Q4_0's z is exactly
0. The codes are the file's own. Activations are bfloat16. `Int4Linear.dequantized` is the matrix
the kernel multiplies by, and tests/test_quant.py checks it against the file.

With `model.activations=int8` the same blocks run through csrc/q4_int8.cpp instead: scale and
minimum kept in float32 (the file's fp16 exactly), codes in the file's nibble order, and each row of
activations quantized to int8 per block of 32 (its scale and sum beside it), so that the
multiply-adds run on the integer units; `Int4Linear.dequantized` is then scale * q + minimum. A
K-quant's factors stay as its file holds them (`KScales`: a float per super-block of 256, small
integers per block: 24 or 20 bytes a block of 8 outputs, not 64), and the kernel forms each product
(the same float32 values: a forward of one token reads the weights once, so bytes are its time). The
attention's q, k and v take their input in two int8 levels (`two_level_inputs`). The kernel returns
its input's type; the model around it runs in float32 on that path (models.py).

On that path a layer in Q8_0, Q5_0 or Q6_K blocks (w = scale * q with signed codes q: one fp16
scale per 32 weights and q in -128..127, or -16..15 for Q5_0; Q6_K's q in -32..31 with a scale per
16, d times a signed 8-bit sub-scale) runs as `Q8Linear`, the same kernel's signed-code format: the
file's weights exactly, int8 activations. Every other tensor type (F16, ...) and every non-4-bit
type on the float path runs in bfloat16: `transformers` dequantizes it to float32 and it is rounded
once. The kernel gives a row the same bits whatever the number of rows
(measured for 1-600 rows), which the batch-invariant forward rests on.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, cast

import numpy as np
import torch

from decoding.base.errors import BackendError
from decoding.runtime import kernels
from decoding.runtime.gguf_tensors import FileTensor, file_tensors, tensor_bytes
from decoding.runtime.pretrained import pretrained
from decoding.runtime.rows_linear import RowsLinear

GROUP = 32  # the kernel's group size along the input dimension, GGUF's 4-bit block (or sub-block)
# model.activations on the int8 kernel -> its inputs per activation scale on a K-quant layer (Q4_K, Q6_K
# with K a multiple of 256; every other layer takes a scale per 32): "int8_256" is llama.cpp's Q8_K rule,
# a super-block's integer sums finished by one float multiply-add per 256 inputs instead of per 32.
INT8_FORMATS = {"int8": GROUP, "int8_256": 256}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
Q8_TYPES = ("Q8_0", "Q5_0", "Q6_K")  # signed codes and a scale per 32 (or 16) weights: Q8Linear on the int8 path
# int8 activations keep the hidden states between the 4-bit products in this type, as llama.cpp does:
# bfloat16 ones would add their rounding to the activations' (docs/performance.md "int8 activations").
INT8_HIDDEN = torch.float32
# ... and the KV cache in this one (llama.cpp's is float16): attention reads the cache whole at every
# token, and float32 keys cost 13-25% of a forward for a KL from float32 1% lower.
INT8_CACHE = torch.bfloat16
# The int8 projections whose input is quantized in two levels (the residual of the first quantized
# again: about 16 bits): q, k and v's error reaches the logits through the softmax of q . k, and on
# the embedded model they carried ~40% of int8's KL from float32 at one level (docs/performance.md).
TWO_LEVEL_INPUTS = ("q_proj", "k_proj", "v_proj")
# Types `transformers` (gguf-py) dequantizes, run in bfloat16.
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "Q8_K")


class Int4Linear(torch.nn.Module):
    """A linear layer y = x W^T (+ b) with W held as 4-bit codes and group scales/zeros: bfloat16
    for torch's kernel (activations="float"), float32 for the int8-activation kernel ("int8")."""

    # Buffers (register_buffer), declared for the type checker: torch's stub types an unknown attribute
    # as a tensor or a module. packed8 and factors on the int8 path, packed and scales_zeros on the other.
    packed8: torch.Tensor
    factors: torch.Tensor
    packed: torch.Tensor
    scales_zeros: torch.Tensor
    codes: torch.Tensor

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        bias: torch.Tensor | None,
        activations: str = "float",
        k_scales: KScales | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.activations = activations
        self.levels = 1  # int8 levels the input is quantized in (two_level_inputs)
        self.k_block = GROUP  # inputs per activation scale where the factors are a K-quant's (use_k_block)
        if activations == "int8":
            kernels.load()  # built now: a missing compiler is a load-time error
            packed, factors = pack_q4(codes, scale, minimum)
            if k_scales is not None and self.in_features % 256 == 0:
                factors = pack_k_factors(k_scales)
            self.register_buffer("packed8", packed)
            self.register_buffer("factors", factors)
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            zero = minimum.float() + 8 * scale.float()
            # [groups, out, 2]: the kernel's layout.
            self.register_buffer("scales_zeros", torch.stack([scale.float().t(), zero.t()], -1).to(torch.bfloat16))
        self.register_buffer("codes", codes.to(torch.uint8), persistent=False)
        dtype = INT8_HIDDEN if activations == "int8" else torch.bfloat16  # the type the layer returns
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations == "int8":
            y: torch.Tensor = kernels.load().q4_int8_linear(
                x, self.packed8, self.factors, _bias(self.bias), self.levels, self.k_block
            )
            return y
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What csrc/layers.cpp passes to the kernel this layer runs (float32 scales: the int8 path)."""
        return (self.packed8, self.factors) if self.activations == "int8" else (self.packed, self.scales_zeros)

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix [out, in] the kernel multiplies by: (q - 8) * s + z per group, or
        scale * q + minimum for the int8 path."""
        if self.activations == "int8":
            s, m = (t.repeat_interleave(GROUP, 1) for t in self.scale_minimum())
            return self.codes.float() * s + m
        s = self.scales_zeros[..., 0].float().t().repeat_interleave(GROUP, 1)
        z = self.scales_zeros[..., 1].float().t().repeat_interleave(GROUP, 1)
        return (self.codes.float() - 8) * s + z

    def scale_minimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 path's scale and minimum per output and block [N, K / 32], float32."""
        n, factors = self.out_features, self.factors
        if factors.dtype == torch.uint8:
            factors = k_factors_floats(factors, halves=False)
        scale, minimum = (factors[:, :, i].permute(0, 2, 1).reshape(n, -1) for i in (0, 1))
        return scale, minimum

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, int4 group {GROUP}, "
            f"{self.activations} activations{_input_format(self)}"
        )


class Q8Linear(torch.nn.Module):
    """A linear layer y = x W^T (+ b) in a GGUF file's signed codes with a scale per block of 32 (Q8_0;
    Q5_0's codes are -16..15 in the same form) or per half block of 16 (Q6_K: `scale` [N, K / 16]),
    multiplied by int8 activations (model.activations=int8: csrc/q4_int8.cpp's Q8 path). An LM head
    keeps `weight`, the bfloat16 matrix (tied to the embedding), for code that reads its rows (EDD's
    head); a decoder projection has none."""

    packed8: torch.Tensor  # buffers (register_buffer), declared for the type checker
    factors: torch.Tensor

    def __init__(
        self,
        weight: torch.nn.Parameter | None,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        k_scales: KScales | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.weight = weight
        self.levels = 1  # int8 levels the input is quantized in (two_level_inputs)
        self.k_block = GROUP  # inputs per activation scale where the factors are a K-quant's (use_k_block)
        self.activations = "int8"
        # The kernel takes outputs in groups of 8: a vocabulary that is not a multiple of 8 gets zero
        # columns, computed and dropped.
        pad = -self.out_features % 8
        self.halves = scale.shape[1] * GROUP // 2 == self.in_features  # a scale per 16 inputs
        codes, scale = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (codes.to(torch.int8), scale.float()))
        packed, factors = pack_q8(codes, scale)
        if k_scales is not None and self.halves and self.in_features % 256 == 0:
            factors = pack_k_factors(k_scales.padded(pad))
        self.register_buffer("packed8", packed)
        self.register_buffer("factors", factors)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(INT8_HIDDEN), requires_grad=False)
        self._padded_bias = None if self.bias is None or not pad else torch.cat([self.bias, self.bias.new_zeros(pad)])
        kernels.load()  # built now: a missing compiler is a load-time error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self._padded_bias is None else self._padded_bias
        y: torch.Tensor = kernels.load().q8_int8_linear(
            x, self.packed8, self.factors, _bias(bias), self.levels, self.k_block
        )
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What csrc/layers.cpp passes to the kernel (which tells the format by the factors' shape)."""
        return self.packed8, self.factors

    def codes_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes [N, K] (int8) and scales [N, K / 32] (or [N, K / 16] in halves; float32), from the
        kernel's layout."""
        n, k = self.packed8.shape[0] * 8, self.in_features
        codes = self.packed8.view(torch.int8).reshape(n // 8, k // GROUP, 8, 8, 4).permute(0, 3, 1, 2, 4)
        factors = k_factors_floats(self.factors, halves=True) if self.factors.dtype == torch.uint8 else self.factors
        scales = factors.permute(0, 3, 1, 2).reshape(n, -1)  # [group, column, block, half]
        return codes.reshape(n, k)[: self.out_features], scales[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix the kernel multiplies by: scale * code per block of 32 (or 16)."""
        codes, scales = self.codes_scales()
        return codes.float() * scales.repeat_interleave(GROUP // 2 if self.halves else GROUP, 1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, Q8, "
            f"int8 activations{_input_format(self)}"
        )


def pack_q4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] in 0..15 and scale, minimum [N, K / 32] in csrc/q4_int8.cpp's layout, in groups of
    8 outputs: codes [N / 8, K / 32 * 128] (per block, vector j's byte 4c + i holds output c's code for
    input 4j + i in its low nibble and for 16 + 4j + i in its high one) and factors [N / 8, K / 32, 2, 8]
    (per block, the 8 outputs' scales, then their minimums)."""
    n, k = codes.shape
    if n % 8 or k % GROUP:
        raise ValueError(f"the int8 kernel takes outputs in groups of 8 and inputs in blocks of 32, not [{n}, {k}]")
    # [group, column, block, half, j, i]: input 16 * half + 4 * j + i of the block
    c = codes.to(torch.uint8).reshape(n // 8, 8, k // GROUP, 2, 4, 4)
    nibbles = c[:, :, :, 0] | (c[:, :, :, 1] << 4)  # [group, column, block, j, i]
    packed = nibbles.permute(0, 2, 3, 1, 4).reshape(n // 8, -1).contiguous()
    factors = torch.stack([scale.float(), minimum.float()], 1)  # [N, 2, blocks]
    factors = factors.reshape(n // 8, 8, 2, -1).permute(0, 3, 2, 1).contiguous()
    return packed, factors


@dataclass(frozen=True)
class KScales:
    """A K-quant's factors as its file holds them, whose products are the float32 factors exactly:
    Q4_K's scale = d sc and minimum = -(dmin mn) with 6-bit sc, mn per 32 inputs; Q6_K's scale = d sub
    with a signed 8-bit sub per 16 (the two halves of a block of 32). Arrays or tensors."""

    d: Any  # [N, K / 256] float32
    small: Any  # [N, K / 32, 2] uint8: Q4_K's (sc, mn), Q6_K's (sub of inputs 0-15, 16-31) as int8 bits
    dmin: Any = None  # [N, K / 256] float32 (Q4_K); None (Q6_K)

    def rows(self, fn: Any) -> KScales:
        """Each array [N, ...] through fn (a row permutation, a conversion to torch)."""
        n = self.small.shape[0]
        small = fn(self.small.reshape(n, -1)).reshape(n, -1, 2)
        return KScales(fn(self.d), small, None if self.dmin is None else fn(self.dmin))

    def padded(self, rows: int) -> KScales:
        """Torch tensors with `rows` zero outputs after the last (a vocabulary padded to 8)."""
        pad = [torch.as_tensor(t) for t in (self.d, self.small, self.dmin) if t is not None]
        d, small, *dmin = (torch.cat([t, t.new_zeros(rows, *t.shape[1:])]) for t in pad)
        return KScales(d, small, dmin[0] if dmin else None)


def pack_k_factors(k: KScales) -> torch.Tensor:
    """A K-quant's factors in csrc/q4_int8.cpp's compact layout, in groups of 8 outputs: uint8
    [N / 8, K / 256, bytes], per super-block the 8 outputs' d (Q4_K: then their dmin) as float32,
    then per block their 8 first small integers and their 8 second."""
    d = torch.as_tensor(k.d).float()
    n, supers = d.shape
    floats = [d] if k.dmin is None else [d, torch.as_tensor(k.dmin).float()]
    head = torch.stack([f.reshape(n // 8, 8, supers) for f in floats], 2)  # [group, column, kind, super]
    head = head.permute(0, 3, 2, 1).contiguous().view(torch.uint8).reshape(n // 8, supers, -1)
    small = torch.as_tensor(k.small).view(torch.uint8).reshape(n // 8, 8, supers, 8, 2)  # [g, col, super, b, kind]
    small = small.permute(0, 2, 3, 4, 1).reshape(n // 8, supers, -1)
    return torch.cat([head, small], -1).contiguous()


def k_factors_floats(compact: torch.Tensor, halves: bool) -> torch.Tensor:
    """pack_k_factors' layout -> the float32 factors [N / 8, K / 32, 2, 8] the kernel forms from it
    (pack_q4's, or pack_q8's in halves), with the same products."""
    groups, supers, _ = compact.shape
    kinds = 1 if halves else 2
    head = compact[..., : 32 * kinds].contiguous().view(torch.float32).reshape(groups, supers, kinds, 1, 8)
    small = compact[..., 32 * kinds :].reshape(groups, supers, 8, 2, 8)
    small = (small.view(torch.int8) if halves else small).float()
    first = head[:, :, 0] * small[:, :, :, 0]  # [group, super, block, column]
    second = head[:, :, 0] * small[:, :, :, 1] if halves else -(head[:, :, 1] * small[:, :, :, 1])
    return torch.stack([first, second], 3).reshape(groups, supers * 8, 2, 8)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed codes [N, K] (int8) and scales [N, K / 32] (or [N, K / 16]: a scale per half block) in
    csrc/q4_int8.cpp's layout, in groups of 8 outputs: codes [N / 8, K / 32 * 256] (per block, vector
    j's byte 4c + i holds output c's code for input 4j + i, int8 viewed as uint8) and factors
    [N / 8, K / 32, 1, 8] (or [N / 8, K / 32, 2, 8]: the 8 outputs' first halves, then second)."""
    n, k = codes.shape
    if n % 8 or k % GROUP:
        raise ValueError(f"the int8 kernel takes outputs in groups of 8 and inputs in blocks of 32, not [{n}, {k}]")
    c = codes.to(torch.int8).reshape(n // 8, 8, k // GROUP, 8, 4)  # [group, column, block, j, i]
    packed = c.permute(0, 2, 3, 1, 4).reshape(n // 8, -1).contiguous().view(torch.uint8)
    per = scale.shape[1] // (k // GROUP)  # scales per block: 1, or 2 in halves
    factors = scale.float().reshape(n // 8, 8, k // GROUP, per).permute(0, 2, 3, 1).contiguous()
    return packed, factors


def decode_q8_0(data: np.ndarray, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 tensor's raw bytes -> codes [N, K] int8 and scales [N, K / 32] float32."""
    blocks = data.reshape(n_out, n_in // GROUP, 34)
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n_out, n_in), _f16(blocks[..., 0:2])


def decode_q5_0(data: np.ndarray, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q5_0 tensor's raw bytes -> codes [N, K] int8 in -16..15 and scales [N, K / 32] float32:
    per block an fp16 scale d, 32 high bits, 16 bytes of low nibbles (weight j's in byte j % 16, low
    nibble for j < 16), w = d * (q - 16)."""
    blocks = data.reshape(n_out, n_in // GROUP, 22)
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [N, blocks, 1]: bit j is weight j's
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    codes = (_nibbles(blocks[..., 6:]) | bits).astype(np.int8) - np.int8(16)
    return codes.reshape(n_out, n_in), _f16(blocks[..., 0:2])


def decode_q6_k(data: np.ndarray, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q6_K tensor's raw bytes -> codes [N, K] int8 in -32..31 and scales [N, K / 16] float32
    (d times each sub-block's signed 8-bit scale). Per super-block of 256: 128 bytes of low nibbles,
    64 of high bit pairs, 16 sub-scales, an fp16 d; each half of 128 weights takes 64 low and 32 high
    bytes, weight 32 i + l from byte l (+ 32 for odd i) of the lows, nibble i // 2, and bit pair i
    of high byte l."""
    blocks = data.reshape(n_out, n_in // 256, 210)
    low = blocks[..., :128].reshape(n_out, -1, 2, 2, 32)  # [.., half, byte block l / 32, l]
    high = blocks[..., 128:192].reshape(n_out, -1, 2, 1, 32)
    nibbles = np.stack([low[..., 0, :] & 0x0F, low[..., 1, :] & 0x0F, low[..., 0, :] >> 4, low[..., 1, :] >> 4], 3)
    pairs = (high >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # [.., half, 4, 32]
    codes = (nibbles | (pairs << 4)).astype(np.int8) - np.int8(32)
    sub = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(blocks[..., 208:210])[..., None] * sub
    return codes.reshape(n_out, n_in), scale.reshape(n_out, -1)


def q6_k_scales(data: np.ndarray, n_out: int, n_in: int) -> KScales:
    """A Q6_K tensor's factors as the file holds them: d per super-block, a signed byte per 16."""
    blocks = data.reshape(n_out, n_in // 256, 210)
    return KScales(_f16(blocks[..., 208:210]), np.ascontiguousarray(blocks[..., 192:208]).reshape(n_out, -1, 2))


def decode_q8(data: np.ndarray, type_name: str, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of a tensor of one of Q8_TYPES."""
    decode = {"Q8_0": decode_q8_0, "Q5_0": decode_q5_0, "Q6_K": decode_q6_k}[type_name]
    return decode(data, n_out, n_in)


@torch.no_grad()
def q8_head_from_gguf(model: torch.nn.Module, path: Path) -> bool:
    """Give the model an LM head on the Q8 path where the file stores it (or the embedding it is tied
    to) in one of Q8_TYPES; whether it did."""
    lm = pretrained(model)
    head = lm.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, RowsLinear) or head.in_features % GROUP:
        return False
    tensors = {t.name: t for t in file_tensors(path)}
    source = tensors.get("output.weight") or (
        tensors.get("token_embd.weight") if getattr(model.config, "tie_word_embeddings", False) else None
    )
    if source is None or source.type_name not in Q8_TYPES:
        return False
    data, shape = tensor_bytes(path, source), (head.out_features, head.in_features)
    codes, scale = decode_q8(data, source.type_name, *shape)
    k = q6_k_scales(data, *shape).rows(torch.from_numpy) if source.type_name == "Q6_K" else None
    bias = None if head.bias is None else head.bias
    lm.set_output_embeddings(Q8Linear(head.weight, torch.from_numpy(codes), torch.from_numpy(scale), bias, k))
    return True


def two_level_inputs(model: torch.nn.Module) -> int:
    """Quantize the input of the model's int8 projections named in TWO_LEVEL_INPUTS in two levels; how many."""
    changed = 0
    for name, module in model.named_modules():
        if takes_int8(module, alone=True) and name.rpartition(".")[2] in TWO_LEVEL_INPUTS:
            module.levels = 2
            changed += 1
    return changed


def use_k_block(model: torch.nn.Module, k_block: int, per_32: Collection[str] = ()) -> int:
    """Give the model's int8 layers `k_block` (INT8_FORMATS): the kernel takes their input with a scale
    per that many inputs where their factors are a K-quant's, per 32 elsewhere and in the layers named
    in `per_32` (module names: a file's inputs whose scale per 256 alone moves the logits, numerics.py);
    how many take `k_block`."""
    changed = 0
    for name, module in model.named_modules():
        if takes_int8(module, alone=True):
            layer = cast(Int4Linear | Q8Linear, module)
            layer.k_block = GROUP if name in per_32 else k_block
            changed += layer.k_block != GROUP and k_quant(layer)
    return changed


def k_quant(layer: Int4Linear | Q8Linear) -> bool:
    """Whether the layer's factors are a K-quant's (a scale per 256 applies to its input)."""
    return layer.factors.dtype == torch.uint8  # pack_k_factors' compact layout


def _input_format(layer: Int4Linear | Q8Linear) -> str:
    levels = " in two levels" if layer.levels == 2 else ""
    return levels + (f", a scale per {layer.k_block} inputs" if layer.k_block != GROUP and k_quant(layer) else "")


def takes_int8(module: torch.nn.Module, alone: bool = False) -> bool:
    """Whether the module's quantized layers (a model's, or one attention layer's) take int8
    activations; `alone`: whether the module itself is such a layer."""
    layers = [module] if alone else module.modules()
    return any(type(m) in (Int4Linear, Q8Linear) and m.activations == "int8" for m in layers)


def cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The KV cache's type: INT8_CACHE where the model's 4-bit layers take int8 activations, else the
    model's own. The attention then runs in that type (decoding/runtime/attention.py)."""
    return INT8_CACHE if takes_int8(model) else next(model.parameters()).dtype


def _bias(bias: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if bias is None else bias


def kernel_fits(module: torch.nn.Module | None) -> TypeGuard[torch.nn.Linear]:
    """Whether the int4 kernel can run this layer (its packing wants groups of 32 in, 16s out)."""
    if type(module) not in (torch.nn.Linear, RowsLinear):  # (RowsLinear is one; other subclasses are not)
        return False
    linear = cast(torch.nn.Linear, module)
    return linear.in_features % GROUP == 0 and linear.out_features % 16 == 0


def dense_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with each `Int4Linear` as the plain `weight` (and `bias`) of the
    matrix it multiplies by: what a bfloat16 copy of the layer loads (EDD starts from a target layer)."""
    int4 = {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, Int4Linear) or (isinstance(m, Q8Linear) and m.weight is None)
    }
    state = {k: v for k, v in module.state_dict().items() if k.rpartition(".")[0] not in int4}
    for name, layer in int4.items():
        state[f"{name}.weight"] = layer.dequantized().to(torch.bfloat16)
        if layer.bias is not None:
            state[f"{name}.bias"] = layer.bias
    return state


@dataclass(frozen=True)
class Int4Blocks:
    """A GGUF 4-bit tensor decoded: codes [N, K] in 0..15, scale and minimum [N, K / 32] (float32)."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    k: KScales | None = None  # Q4_K's factors as the file holds them

    def weights(self) -> np.ndarray:
        """w = scale * q + minimum, float32 (as gguf-py dequantizes Q4_1 and Q4_K)."""
        w: np.ndarray = self.codes * np.repeat(self.scale, GROUP, 1) + np.repeat(self.minimum, GROUP, 1)
        return w


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16 * n] -> codes [..., 32 * n]: each 16 bytes hold 32 codes, low nibbles first."""
    lead = qs.shape[:-1]
    q = qs.reshape(*lead, -1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    codes: np.ndarray = (q & np.uint8(0x0F)).reshape(*lead, -1)
    return codes


def _f16(raw: np.ndarray) -> np.ndarray:
    floats: np.ndarray = np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]
    return floats


def decode_int4(data: np.ndarray, type_name: str, n_out: int, n_in: int) -> Int4Blocks:
    """Decode a GGUF tensor's raw bytes [N, bytes per row] of a 4-bit type."""
    rows = data.reshape(n_out, -1)
    if type_name in ("Q4_0", "Q4_1"):
        per = 18 if type_name == "Q4_0" else 20
        blocks = rows.reshape(n_out, n_in // GROUP, per)
        scale = _f16(blocks[..., 0:2])
        minimum = -8 * scale if type_name == "Q4_0" else _f16(blocks[..., 2:4])
        codes = _nibbles(blocks[..., per - 16 :]).reshape(n_out, n_in)
        return Int4Blocks(codes, scale, minimum)
    if type_name == "Q4_K":
        blocks = rows.reshape(n_out, n_in // 256, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scale_min(blocks[..., 4:16])
        # Each 32 bytes hold two sub-blocks: low nibbles the first, high nibbles the second.
        qs = blocks[..., 16:].reshape(n_out, n_in // 256, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
        codes = (qs & np.uint8(0x0F)).reshape(n_out, n_in)
        scale = (d[..., None] * sc).reshape(n_out, -1)
        minimum = -(dmin[..., None] * mn).reshape(n_out, -1)
        small = np.stack([sc, mn], -1).astype(np.uint8).reshape(n_out, -1, 2)
        return Int4Blocks(codes, scale, minimum, KScales(d, small, dmin))
    raise BackendError(f"{type_name} is not a 4-bit GGUF type this loader decodes ({', '.join(INT4_TYPES)})")


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and minimums of 8 sub-blocks -> two float32 arrays [..., 8]."""
    p = packed.reshape(*packed.shape[:-1], 3, 4)
    d, m, md = p[..., 0, :], p[..., 1, :], p[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


class _TopLevel:
    """What transformers' get_gguf_hf_weights_map reads of a model, without the submodules it would
    also walk (each walk builds gguf's name table again: 8 s for the embedded model's 397 modules);
    the top level's names are the ones the state dict uses."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state

    def named_children(self) -> list[tuple[str, torch.nn.Module]]:
        return []


def check_types(path: Path, key: str) -> dict[str, int]:
    """Tensor types of a GGUF file and how many tensors have each; an error names an unsupported one."""
    counts: dict[str, int] = {}
    for tensor in file_tensors(path):
        name = tensor.type_name
        if name not in INT4_TYPES + DEQUANTIZED_TYPES:
            raise BackendError(
                f"{key}.path={path}: tensor {tensor.name} has GGUF type {name}, which this loader does not run "
                f"(supported: {', '.join(INT4_TYPES + DEQUANTIZED_TYPES)}); convert the file with llama.cpp's "
                "llama-quantize to Q4_K_M or Q8_0"
            )
        counts[name] = counts.get(name, 0) + 1
    return counts


def _linear_tensors(
    model: torch.nn.Module, path: Path
) -> tuple[list[tuple[FileTensor, str, torch.nn.Module | None]], Any]:
    """Each tensor of the file with the name of the model's weight it fills and that weight's module
    (None where it is no module's), and the processor that undoes the converter's permutations."""
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = pretrained(model).config
    # (typed as the base class: a call through the dict's joined value type is not seen as transformers')
    processor_class: type[TensorProcessor] = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)
    processor = processor_class(config=config.to_dict())
    names = get_gguf_hf_weights_map(_TopLevel(model), processor)
    modules = dict(model.named_modules())
    out = []
    for tensor in file_tensors(path):
        hf_name = names.get(tensor.name, "")
        out.append((tensor, hf_name, modules.get(hf_name.removesuffix(".weight"))))
    return out, processor


@torch.no_grad()
def quantize_from_gguf(model: torch.nn.Module, path: Path, activations: str = "float") -> dict[str, int]:
    """Replace the model's linear layers whose GGUF tensors are 4-bit by `Int4Linear`s built from the
    file's own codes, and with int8 activations those in Q8_TYPES by `Q8Linear`s (the LM head apart:
    q8_head_from_gguf), multiplying their input as `activations`; the rest of the model runs in
    bfloat16. Returns how many layers of each GGUF type were replaced."""
    head = pretrained(model).get_output_embeddings()
    modules = dict(model.named_modules())
    tensors, processor = _linear_tensors(model, path)
    replaced: dict[str, int] = {}
    for tensor, hf_name, module in tensors:
        kind = tensor.type_name
        q8 = kind in Q8_TYPES and activations == "int8" and module is not head
        if not (kind in INT4_TYPES or q8) or not kernel_fits(module):
            continue
        data, shape = tensor_bytes(path, tensor), (module.out_features, module.in_features)

        # The converter permuted q/k rows for llama.cpp's rotary layout; undo it as transformers does.
        def rows(a: np.ndarray, name: str = tensor.name) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(processor.process(a, name).weights))

        if q8:
            k = q6_k_scales(data, *shape).rows(rows) if kind == "Q6_K" else None
            codes, scale = (rows(a) for a in decode_q8(data, kind, *shape))
            layer: torch.nn.Module = Q8Linear(None, codes, scale, module.bias, k)
        else:
            blocks = decode_int4(data, kind, *shape)
            k = None if blocks.k is None else blocks.k.rows(rows)
            codes, scale, minimum = (rows(a) for a in (blocks.codes, blocks.scale, blocks.minimum))
            layer = Int4Linear(codes, scale, minimum, module.bias, activations, k)
        parent, _, child = hf_name.removesuffix(".weight").rpartition(".")
        setattr(modules[parent] if parent else model, child, layer)
        replaced[kind] = replaced.get(kind, 0) + 1
    return replaced


def float_layers(model: torch.nn.Module, path: Path) -> dict[str, int]:
    """The GGUF types of the linear layers (the LM head included) still on the float path after
    quantize_from_gguf and q8_head_from_gguf, with how many of each: what the int8 kernels lack."""
    head = pretrained(model).get_output_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", False)
    left: dict[str, int] = {}
    for tensor, _, module in _linear_tensors(model, path)[0]:
        if tensor.name == "token_embd.weight" and tied:
            module = head  # the head is the embedding's weight
        if isinstance(module, torch.nn.Linear):  # RowsLinear too: a float kernel
            kind = tensor.type_name
            left[kind] = left.get(kind, 0) + 1
    return left
