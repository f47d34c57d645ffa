"""Models for the runtime's tests that make tensor constants inside forward with torch.tensor
(aten.lift_fresh): the constant's storage is made outside the dispatcher and lives only while
forward runs. GPT-2's attention in transformers before the sdpa rewrite did so for its mask value
(`torch.tensor(torch.finfo(dtype).min, dtype=..., device=...)` and `torch.where`)."""

from __future__ import annotations

import torch
from torch import nn

SEQ, DIM = 8, 16


class MaskedAttention(nn.Module):
    """Attention-like scores, scaled and causally masked by constants made in forward (the
    scores are elementwise products: no batched matmul, whose reshapes are another matter)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(DIM, 2 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.register_buffer("causal", torch.tril(torch.ones(SEQ, DIM, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        w = q * k
        w = w / torch.tensor(DIM ** 0.5, dtype=w.dtype, device=w.device)
        mask_value = torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(self.causal, w, mask_value)
        return x + self.out(torch.softmax(w, dim=-1) * x)


def masked_attention(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    """Four attention blocks and a linear head over (batch, SEQ, DIM) inputs, MSE loss."""
    net = nn.Sequential(*[MaskedAttention() for _ in range(4)], nn.Linear(DIM, DIM))
    x = torch.randn(batch, SEQ, DIM)
    return net, (x, torch.randn(batch, SEQ, DIM)), nn.MSELoss()
