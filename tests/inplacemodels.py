"""Tiny CPU stand-ins for the torchvision blocks whose recomputation plans gave wrong gradients on
the H100 (validation/measured/*-recompute-sqrt-*.json, issue 13): in-place updates of tensors a
recomputed chain reads or rebuilds, and random numbers drawn inside a chain.

- `bottlenecks`: torchvision's ResNet Bottleneck (`out += identity`, then ReLU(inplace)).
- `mbconvs`: EfficientNet's MBConv: SiLU(inplace) after batch norms, a squeeze-excitation block,
  stochastic depth (torch.bernoulli_ on an empty tensor, div_) and `result += input`.
- `hardswish_blocks`: MobileNetV3's inverted residual: Hardswish(inplace), an SE block with
  ReLU and Hardsigmoid, `result += input`.
- `cnblocks`: ConvNeXt's block: depthwise conv, LayerNorm over permuted channels, layer scale,
  stochastic depth, `result += input`.
"""

from __future__ import annotations

import torch
from torch import nn

from vsim.record.zoo import Bottleneck

SIZE, CLASSES = 16, 10


def _images(batch: int, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(batch, channels, SIZE, SIZE, generator=gen),
            torch.randint(0, CLASSES, (batch,), generator=gen))


def _stem(c: int) -> list[nn.Module]:
    return [nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]


def _head(c: int) -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, CLASSES)]


def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torchvision.ops.stochastic_depth, mode 'row'."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return x * noise


class SqueezeExcitation(nn.Module):
    def __init__(self, c: int, squeeze: int, act: type[nn.Module],
                 gate: type[nn.Module]) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, c, 1)
        self.act = act()
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.gate(self.fc2(self.act(self.fc1(self.avgpool(x)))))
        return s * x


class MBConv(nn.Module):
    def __init__(self, c: int, p: float, act: type[nn.Module] = nn.SiLU,
                 se_act: type[nn.Module] = nn.SiLU, gate: type[nn.Module] = nn.Sigmoid) -> None:
        super().__init__()
        e = 2 * c
        self.block = nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), act(inplace=True),  # type: ignore[call-arg]
            nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), nn.BatchNorm2d(e),
            act(inplace=True),  # type: ignore[call-arg]
            SqueezeExcitation(e, max(1, c // 4), se_act, gate),
            nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = stochastic_depth(self.block(x), self.p, self.training)
        result += x
        return result


class CNBlock(nn.Module):
    def __init__(self, c: int, p: float) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, 1, 3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1 = nn.Linear(c, 4 * c)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * c, c)
        self.layer_scale = nn.Parameter(torch.full((c, 1, 1), 0.5))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(self.act(self.fc1(self.norm(y)))).permute(0, 3, 1, 2)
        result = stochastic_depth(self.layer_scale * y, self.p, self.training)
        result += x
        return result


def _net(blocks: list[nn.Module], c: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*_stem(c), *blocks, *_head(c))


def bottlenecks(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    """Stem, six torchvision Bottlenecks (16 channels, width 4; the first with a downsample),
    head."""
    torch.manual_seed(0)
    blocks = [Bottleneck(8, 4)] + [Bottleneck(16, 4) for _ in range(5)]
    net = nn.Sequential(*_stem(8), *blocks, *_head(16))
    return net, _images(batch), nn.CrossEntropyLoss()


def mbconvs(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    """Stem, six MBConv blocks (SiLU in place, SE, stochastic depth 0.2), head."""
    torch.manual_seed(0)
    return (_net([MBConv(8, 0.2) for _ in range(6)], 8), _images(batch),
            nn.CrossEntropyLoss())


def mbconvs_no_drop(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor],
                                         nn.Module]:
    """`mbconvs` without stochastic depth: in-place SiLU and `result += input` alone."""
    torch.manual_seed(0)
    return (_net([MBConv(8, 0.0) for _ in range(6)], 8), _images(batch),
            nn.CrossEntropyLoss())


def hardswish_blocks(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor],
                                          nn.Module]:
    """Stem, six MobileNetV3-style blocks (Hardswish in place, SE with ReLU and Hardsigmoid)."""
    torch.manual_seed(0)
    return (_net([MBConv(8, 0.0, nn.Hardswish, nn.ReLU, nn.Hardsigmoid) for _ in range(6)], 8),
            _images(batch), nn.CrossEntropyLoss())


def cnblocks(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    """Stem, six ConvNeXt blocks (layer scale, stochastic depth 0.1, `result += input`)."""
    torch.manual_seed(0)
    return (_net([CNBlock(8, 0.1) for _ in range(6)], 8), _images(batch),
            nn.CrossEntropyLoss())


class VitBlock(nn.Module):
    """torchvision's ViT EncoderBlock: x + dropout(MultiheadAttention(ln(x))), then
    x + MLP(ln(x)) (GELU, dropout)."""

    def __init__(self, d: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        # need_weights: attention through bmm and softmax (on the CPU, scaled_dot_product_
        # attention's math path records _reshape_alias where a mapping pass sees views)
        y, _ = self.self_attention(y, y, y, need_weights=True)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class Vit(nn.Module):
    """Patch embedding (a strided conv), class token, position embedding, ViT blocks, head."""

    def __init__(self, d: int = 16, layers: int = 6, heads: int = 2, patch: int = 4) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        n = (SIZE // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.randn(1, n, d) * 0.02)
        self.blocks = nn.Sequential(*(VitBlock(d, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln(self.blocks(x + self.pos_embedding))
        return self.head(x[:, 0])


def vit_blocks(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], nn.Module]:
    """A small torchvision-style ViT. Its in-projection is a linear of a transposed 3D input:
    linear adds the bias in place without a Python dispatch mode and out of place under one
    (the H100's vit_b_16 sqrt plan under the native tracker recorded the in-place add as the
    calibration's out-of-place one, and its recomputation read a state that was gone)."""
    torch.manual_seed(0)
    return Vit(), _images(batch), nn.CrossEntropyLoss()
