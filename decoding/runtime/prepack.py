"""Linear layers with a prepacked oneDNN copy of their weights, for CPU forwards of several token rows.

On a CPU a float32 `nn.Linear` repacks its weight matrix on every call with more than one input row,
so a forward over 2-16 token rows costs far more than one over a single row, although the weights
read are the same. Measured with the embedded SmolLM2-135M on this project's 2-core machine (one
verification forward after 300 tokens, batch x tokens per row): 1x1 45.5 ms; 1x4 83.9 ms plainly,
50.8 ms prepacked; 1x16 95.6 -> 68.2; 3x1 97.8 -> 53.3; 8x1 90.0 -> 63.3; logits within 7e-5. That
is the cost of a draft tree and of a batch of trajectories, so every decoder gains, `ar` on a batch
too. One-row calls keep the plain path (it is as fast there), and so do calls that record gradients.
"""

from __future__ import annotations

from typing import cast

import torch


class PrepackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose multi-row inference calls use a prepacked copy of its weights. The copy
    is taken once (`prepack_linears`): the weights must not change afterwards (a frozen model)."""

    # (weight, bias or None) as oneDNN tensors; a tuple keeps them out of the state dict.
    packed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The copy serves CPU float32 inference over several rows only (a model moved or cast later,
        # or being trained, takes the plain path).
        packed = self.packed
        plain = packed is None or torch.is_grad_enabled() or x.numel() == x.shape[-1]
        if plain or x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.device.type != "cpu":
            return super().forward(x)
        assert packed is not None, "`plain` holds where there is no prepacked copy"
        shape = x.shape
        y: torch.Tensor = torch.ops.aten.mkldnn_linear(x.reshape(-1, shape[-1]).to_mkldnn(), *packed).to_dense()
        return y.reshape(*shape[:-1], y.shape[-1])


def prepack_supported(model: torch.nn.Module) -> bool:
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and torch.backends.mkldnn.is_available()


@torch.no_grad()
def prepack_linears(model: torch.nn.Module) -> int:
    """Give every `nn.Linear` of a frozen CPU float32 model a prepacked weight copy, in place (the
    modules and their parameters stay, tied weights stay tied); returns how many. 0 where oneDNN
    or the device and dtype do not allow it."""
    if not prepack_supported(model):
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = PrepackedLinear
            prepacked = cast(PrepackedLinear, module)  # (the class just set)
            bias = None if module.bias is None else module.bias.detach().to_mkldnn()
            prepacked.packed = (module.weight.detach().to_mkldnn(), bias)
            n += 1
    return n
