"""Model zoo for recording: the vDNN paper's networks, deep VGG-N and ResNet-N, a GPT-2-small-sized
encoder, Hugging Face transformers by name (vsim.record.hf), torchvision models by name, tiny
models for tests, and `module:callable` for users' own.

`build_model(name, batch, device)` returns (module, (inputs, target), loss_fn) with everything on
`device`; one training step is `loss_fn(module(inputs), target).backward()`. Weights are initialised
from a fixed seed so two recordings of one model see the same tensors.

Layer configurations follow soumith/convnet-benchmarks (torch7/imagenet_winners), as the vDNN
paper did (MICRO-49, 2016, section V): AlexNet is the two-tower "One Weird Trick" net at 224x224,
OverFeat is the fast model at 231x231, both without dropout; VGG-16 is Simonyan and Zisserman's
model D without dropout (convnet-benchmarks comments dropout out); GoogLeNet is Inception v1 without
LRN or auxiliary heads, with "same" padding in the inception branches (convnet-benchmarks'
DepthConcat zero-pads unpadded branches instead; the padded form keeps shapes aligned and is what
Szegedy et al. describe). ReLUs are in place, as in the vDNN baseline.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .hf import HF_MODELS, build_hf

LossFn = Callable[[Any, Any], torch.Tensor]

IMAGENET_CLASSES = 1000

_DESCRIPTIONS: dict[str, str] = {
    "alexnet": "AlexNet, two towers as in convnet-benchmarks (vDNN's config), 224x224, no dropout",
    "overfeat": "OverFeat fast as in convnet-benchmarks (vDNN's config), 231x231, no dropout",
    "googlenet": "GoogLeNet / Inception v1 as in convnet-benchmarks (no LRN, no aux heads), "
                 "224x224",
    "vgg11": "VGG-11 (model A), 224x224, no dropout",
    "vgg13": "VGG-13 (model B), 224x224, no dropout",
    "vgg16": "VGG-16 (model D) as in the vDNN paper, 224x224, no dropout",
    "vgg19": "VGG-19 (model E), 224x224, no dropout",
    "vgg116": "VGG-16 + 100 conv layers (+20 3x3 convs in each of the 5 groups), vDNN's deep VGG",
    "vgg216": "VGG-16 + 200 conv layers (+40 per group)",
    "vgg316": "VGG-16 + 300 conv layers (+60 per group)",
    "vgg416": "VGG-16 + 400 conv layers (+80 per group)",
    "resnet50": "ResNet-50 (bottleneck stages 3,4,6,3; torchvision's v1.5 layout), 224x224",
    "resnet101": "ResNet-101 (stages 3,4,23,3)",
    "resnet152": "ResNet-152 (stages 3,8,36,3)",
    "resnet200": "ResNet-200 (stages 3,24,36,3)",
    "resnet1001": "ResNet-1001: 333 bottleneck blocks as stages 3,8,319,3",
    "resnet1517": "ResNet-1517: 505 bottleneck blocks as stages 3,8,491,3",
    "gpt2-encoder": "GPT-2-small-sized transformer encoder: 12 layers, d=768, 12 heads, seq 512, "
                    "vocab 50257, tied LM head, next-token cross-entropy",
    "tiny-mlp": "3-layer MLP on 64 features (for tests)",
    "tiny-cnn": "2 convs + pool + fc on 3x16x16 (for tests)",
    "tiny-resnet": "2 residual blocks with batch norm on 3x16x16 (for tests)",
    "tiny-transformer": "2-layer transformer encoder, d=32, seq 16, tied embedding (for tests)",
    "resnetN": "any N = 3k+2 >= 50: k bottleneck blocks as stages 3,8,k-14,3 unless N is listed",
    "vggN": "any N = 16 + 100j: VGG-16 with 20j extra 3x3 convs per group",
    "torchvision:NAME": "any torchvision.models model by name (needs torchvision), 224x224 "
                        "(299 for inception_v3)",
    "MODULE:CALLABLE": "your own: CALLABLE(batch) returns (module, (inputs, target), loss_fn)",
}
_DESCRIPTIONS.update({name: f"{text} (needs transformers; --seq, default {seq})"
                      for name, (text, seq) in HF_MODELS.items()})


def list_models() -> dict[str, str]:
    """Model names (and name patterns) build_model accepts, with a one-line description."""
    return dict(_DESCRIPTIONS)


# ---------------------------------------------------------------- the vDNN paper's networks

class TwoTower(nn.Module):
    """Two copies of a branch on the same input, concatenated on channels (AlexNet's towers)."""

    def __init__(self, make_branch: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.tower1 = make_branch()
        self.tower2 = make_branch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.tower1(x), self.tower2(x)], dim=1)


def alexnet() -> nn.Module:
    def tower() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 48, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(48, 128, 5, 1, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(128, 192, 3, 1, 1), nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, 3, 1, 1), nn.ReLU(inplace=True),
            nn.Conv2d(192, 128, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
    return nn.Sequential(
        TwoTower(tower), nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, IMAGENET_CLASSES))


def overfeat() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, 4), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Conv2d(96, 256, 5, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Conv2d(256, 512, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(512, 1024, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(1024, 1024, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Flatten(),
        nn.Linear(1024 * 6 * 6, 3072), nn.ReLU(inplace=True),
        nn.Linear(3072, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, IMAGENET_CLASSES))


_VGG_GROUPS = {  # convs per group for the 5 groups (64, 128, 256, 512, 512 channels)
    11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4),
}


def vgg(depth: int) -> nn.Module:
    """VGG-11/13/16/19, or VGG-(16+100j): VGG-16 with 20j extra 3x3 convs in each group."""
    groups: tuple[int, ...]
    if depth in _VGG_GROUPS:
        groups = _VGG_GROUPS[depth]
    elif depth > 16 and (depth - 16) % 100 == 0:
        extra = (depth - 16) // 100 * 20
        groups = tuple(n + extra for n in _VGG_GROUPS[16])
    else:
        raise ConfigError(f"no VGG-{depth}: use 11, 13, 16, 19 or 16+100j (116, 216, ...)")
    return vgg_from_groups(groups)


def vgg_from_groups(groups: tuple[int, ...]) -> nn.Module:
    """A VGG with `groups[i]` 3x3 convolutions (and in-place ReLUs) in group i, each group
    closed by a 2x2 max pool, then the three fully connected layers."""
    layers: list[nn.Module] = []
    cin = 3
    for cout, n in zip((64, 128, 256, 512, 512), groups, strict=True):
        for _ in range(n):
            layers += [nn.Conv2d(cin, cout, 3, 1, 1), nn.ReLU(inplace=True)]
            cin = cout
        layers.append(nn.MaxPool2d(2, 2))
    return nn.Sequential(
        nn.Sequential(*layers), nn.Flatten(),
        nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True),
                      nn.Linear(4096, 4096), nn.ReLU(inplace=True),
                      nn.Linear(4096, IMAGENET_CLASSES)))


class Inception(nn.Module):
    """GoogLeNet's inception module: 1x1, 1x1-3x3, 1x1-5x5 and pool-1x1 branches, concatenated."""

    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, cp: int) -> None:
        super().__init__()
        relu = lambda: nn.ReLU(inplace=True)  # noqa: E731
        self.branch1 = nn.Sequential(nn.Conv2d(cin, c1, 1), relu())
        self.branch3 = nn.Sequential(nn.Conv2d(cin, c3r, 1), relu(),
                                     nn.Conv2d(c3r, c3, 3, padding=1), relu())
        self.branch5 = nn.Sequential(nn.Conv2d(cin, c5r, 1), relu(),
                                     nn.Conv2d(c5r, c5, 5, padding=2), relu())
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, cp, 1), relu())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x),
                          self.branch_pool(x)], dim=1)


def googlenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.Conv2d(64, 64, 1), nn.ReLU(inplace=True),
        nn.Conv2d(64, 192, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
        Inception(192, 64, 96, 128, 16, 32, 32),
        Inception(256, 128, 128, 192, 32, 96, 64),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Inception(480, 192, 96, 208, 16, 48, 64),
        Inception(512, 160, 112, 224, 24, 64, 64),
        Inception(512, 128, 128, 256, 24, 64, 64),
        Inception(512, 112, 144, 288, 32, 64, 64),
        Inception(528, 256, 160, 320, 32, 128, 128),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        Inception(832, 256, 160, 320, 32, 128, 128),
        Inception(832, 384, 192, 384, 48, 128, 128),
        nn.AvgPool2d(7, 1), nn.Flatten(), nn.Dropout(0.4),
        nn.Linear(1024, IMAGENET_CLASSES))


# ---------------------------------------------------------------- ResNet-N

class Bottleneck(nn.Module):
    """1x1-3x3-1x1 bottleneck with the stride on the 3x3 (torchvision's ResNet v1.5)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm and a residual (used by tiny-resnet)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, stages: tuple[int, int, int, int]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        built = []
        for i, (blocks, width) in enumerate(zip(stages, (64, 128, 256, 512), strict=True)):
            layers = []
            for b in range(blocks):
                layers.append(Bottleneck(cin, width, 2 if (b == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            built.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = built
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, IMAGENET_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_RESNET_STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}


def resnet_stages(depth: int) -> tuple[int, int, int, int]:
    """Bottleneck blocks per stage for ResNet-`depth` (depth = 3 x blocks + 2). Depths past the
    published ones put the extra blocks in stage 3, as ResNet-101 and -152 do."""
    if depth in _RESNET_STAGES:
        return _RESNET_STAGES[depth]
    blocks, rest = divmod(depth - 2, 3)
    if rest or blocks < 15:
        raise ConfigError(f"no ResNet-{depth}: bottleneck ResNets have depth 3k+2 with k >= 15 "
                          "(50, 101, 152, 200, 1001, 1517, ...)")
    return (3, 8, blocks - 14, 3)


# ---------------------------------------------------------------- GPT-2-sized encoder

class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional: an encoder
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class EncoderBlock(nn.Module):
    """GPT-2's pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)), with residual dropout."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.drop_1 = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d, d))
        self.drop_2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_1(self.attn(self.ln_1(x)))
        return x + self.drop_2(self.mlp(self.ln_2(x)))


class Encoder(nn.Module):
    """Token and position embeddings, encoder blocks, final norm, LM head tied to the embedding
    (a shared weight)."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(EncoderBlock(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.pos: torch.Tensor
        self.register_buffer("pos", torch.arange(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(self.pos[: idx.shape[1]]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TokenLoss(nn.Module):
    """Cross-entropy of (batch, seq, vocab) logits against (batch, seq) targets."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.ce(logits.view(-1, logits.shape[-1]), target.view(-1))


class OutputLoss(nn.Module):
    """Cross-entropy on a model's logits, also when the model returns a tuple or an object with
    `.logits` (torchvision's Inception and GoogLeNet outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            output = getattr(output, "logits", None) if hasattr(output, "logits") else output[0]
        return self.ce(output, target)


# ---------------------------------------------------------------- building

def _images(batch: int, size: int, device: Any, classes: int = IMAGENET_CLASSES,
            channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


def _tokens(batch: int, seq: int, vocab: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)


def _to_device(obj: Any, device: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _builtin(name: str, batch: int, device: Any) -> tuple[nn.Module, tuple[Any, Any], LossFn]:
    ce: LossFn = nn.CrossEntropyLoss()
    if name == "alexnet":
        return alexnet(), _images(batch, 224, device), ce
    if name == "overfeat":
        return overfeat(), _images(batch, 231, device), ce
    if name == "googlenet":
        return googlenet(), _images(batch, 224, device), ce
    m = re.fullmatch(r"vgg(\d+)|resnet-?(\d+)", name)
    if m:
        try:
            model = vgg(int(m.group(1))) if m.group(1) else \
                ResNet(resnet_stages(int(m.group(2))))
        except ConfigError:
            if _torchvision_has(name):  # resnet18/34: torchvision's basic-block ResNets
                raise KeyError(name) from None
            raise
        return model, _images(batch, 224, device), ce
    if name == "gpt2-encoder":
        return (Encoder(50257, 512, 768, 12, 12), _tokens(batch, 512, 50257, device),
                TokenLoss())
    if name == "tiny-mlp":
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, 64, generator=gen), torch.randint(0, 10, (batch,), generator=gen)
        return model, (x.to(device), y.to(device)), ce
    if name == "tiny-cnn":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                              nn.Conv2d(8, 16, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
        return model, _images(batch, 16, device, classes=10), ce
    if name == "tiny-resnet":
        model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                              nn.ReLU(inplace=True), BasicBlock(8), BasicBlock(8),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
        return model, _images(batch, 16, device, classes=10), ce
    if name == "tiny-transformer":
        return (Encoder(100, 16, 32, 2, 2, dropout=0.1), _tokens(batch, 16, 100, device),
                TokenLoss())
    raise KeyError(name)


def _torchvision(name: str, batch: int, device: Any) -> tuple[nn.Module, tuple[Any, Any], LossFn]:
    try:
        import torchvision  # noqa: F401  (only on machines that have it)
        from torchvision import models
    except ImportError:
        raise ConfigError(f"model {name!r} needs torchvision, which is not installed") from None
    try:
        kwargs: dict[str, Any] = {"weights": None}
        if name in ("inception_v3", "googlenet"):
            kwargs.update(aux_logits=False, init_weights=False)
        model = models.get_model(name, **kwargs)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"torchvision has no model {name!r} ({exc})") from None
    size = 299 if name == "inception_v3" else 224
    return model, _images(batch, size, device), OutputLoss()


def _torchvision_has(name: str) -> bool:
    try:
        from torchvision import models
    except ImportError:
        return False
    return name in models.list_models()


def _user(spec: str, batch: int, device: Any) -> tuple[nn.Module, tuple[Any, Any], LossFn]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for model {spec!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{module_name} has no callable {attr!r} (model {spec!r})")
    built = factory(batch)
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[0], nn.Module)
            and isinstance(built[1], (tuple, list)) and len(built[1]) == 2
            and callable(built[2])):
        raise ConfigError(f"{spec}({batch}) must return (module, (inputs, target), loss_fn)")
    model, (inputs, target), loss_fn = built
    return model, (inputs, target), loss_fn


def build_model(name: str, batch: int, device: Any, seq: int | None = None
                ) -> tuple[nn.Module, tuple[Any, Any], LossFn]:
    """(module, (inputs, target), loss_fn) on `device`, weights from seed 0. `seq`: sequence
    length of a Hugging Face model (vsim.record.hf; None: its default). ConfigError for an
    unknown name (listing the known ones), a bad batch size or a `seq` the model cannot take."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch size must be a positive integer, got {batch!r}")
    if seq is not None and name not in HF_MODELS:
        raise ConfigError(f"--seq applies to the Hugging Face models ({', '.join(HF_MODELS)}), "
                          f"not {name!r}")
    torch.manual_seed(0)
    loss_fn: LossFn
    if name in HF_MODELS:
        model, batch_data, loss_fn = build_hf(name, batch, seq, device, _tokens)
    elif name.startswith(("torchvision:", "tv:")):
        model, batch_data, loss_fn = _torchvision(name.split(":", 1)[1], batch, device)
    elif ":" in name:
        model, batch_data, loss_fn = _user(name, batch, device)
    else:
        try:
            model, batch_data, loss_fn = _builtin(name, batch, device)
        except KeyError:
            if _torchvision_has(name):
                model, batch_data, loss_fn = _torchvision(name, batch, device)
            else:
                known = ", ".join(n for n in _DESCRIPTIONS if n not in ("resnetN", "vggN"))
                raise ConfigError(f"unknown model {name!r}; known: {known}") from None
    model = model.to(device)
    if isinstance(loss_fn, nn.Module):
        loss_fn = loss_fn.to(device)
    return model, _to_device(tuple(batch_data), device), loss_fn
