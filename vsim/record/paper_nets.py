"""The vDNN paper's networks where they differ from the zoo's, as `MODULE:CALLABLE` models
(`vsim synth vsim.record.paper_nets:vgg16 --batch 64 ...`), and convnet-benchmarks' AlexNet for
calibrating the Titan X.

The paper's "VGG-16" has 16 CONV layers: its Fig. 5 lists CONV1..CONV16 with feature maps (X+Y,
batch 256, MiB) 3282, 6272, 2352, 3136, 1176, 1568 x3, 588, 784 x3, 196 x4, which are exactly
Simonyan and Zisserman's configuration E (2, 2, 4, 4, 4 convolutions per group: 64@224 twice,
128@112 twice, 256@56 four times, ...), not D (2, 2, 3, 3, 3); its Fig. 4 feature maps for
VGG-16(64), 4029 MiB, are E's sum of layer outputs (4039 MiB) where D's is 3720 MiB, and its
weights, 559 MiB, are closer to E's 548 than D's 528. So `vgg16` here is configuration E (the
zoo's vgg19) and `vgg116`..`vgg416` add 20, 40, 60, 80 3x3 convolutions to each of E's five
groups (116..416 CONV layers, as the paper counts them). The zoo's vgg16 stays model D (what
PyTorch users run). ReLUs are in place, as in the vDNN baseline; no dropout.

`alexnet_owt` is convnet-benchmarks' AlexNet ("One Weird Trick", one tower: 64, 192, 384, 256,
256 channels), which is also the paper's AlexNet(128): its Fig. 4 feature maps, 366 MiB, and
gradient maps, 193 MiB, are this net's 362 and 189 (two buffers of conv1's 94.5 MiB output),
where the zoo's two-tower `alexnet` has 460 and 142 (both have 231 MiB of weights).
`overfeat_accurate` likewise (see its docstring). GoogLeNet is the zoo's.

The other seeds: `alexnet_caffe` is SuperNeurons' AlexNet (its testing/alexnet.cpp, Caffe's
bvlc_alexnet without groups: LRN after the first two CONV/ReLU pairs, dropout after fc6/fc7,
227x227), whose CONV1-4 outputs at batch 200 are Fig. 10's 221.56 / 142.38 / 49.51 / 49.51 MiB;
`resnet34` is He et al.'s 34-layer ResNet of basic blocks (Layrub's Table 6), as torchvision
defines it (written out here: torchvision is not a dependency).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .zoo import IMAGENET_CLASSES, _images, vgg_from_groups

_E_GROUPS = (2, 2, 4, 4, 4)


def vgg_e(extra_per_group: int = 0) -> nn.Module:
    """VGG configuration E with `extra_per_group` more 3x3 convolutions in each group."""
    return vgg_from_groups(tuple(n + extra_per_group for n in _E_GROUPS))


def _build(model: nn.Module, batch: int, size: int = 224) -> tuple[nn.Module, Any, Any]:
    # the default device: meta under synthesis (the zoo moves everything to its device after)
    return model, _images(batch, size, torch.get_default_device()), nn.CrossEntropyLoss()


def vgg16(batch: int) -> tuple[nn.Module, Any, Any]:
    """The paper's VGG-16: configuration E (16 CONV layers)."""
    return _build(vgg_e(0), batch)


def vgg116(batch: int) -> tuple[nn.Module, Any, Any]:
    return _build(vgg_e(20), batch)


def vgg216(batch: int) -> tuple[nn.Module, Any, Any]:
    return _build(vgg_e(40), batch)


def vgg316(batch: int) -> tuple[nn.Module, Any, Any]:
    return _build(vgg_e(60), batch)


def vgg416(batch: int) -> tuple[nn.Module, Any, Any]:
    return _build(vgg_e(80), batch)


def alexnet_owt(batch: int) -> tuple[nn.Module, Any, Any]:
    """convnet-benchmarks' AlexNet (One Weird Trick), 224x224, no dropout."""
    model = nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, 1, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, IMAGENET_CLASSES))
    return _build(model, batch)


def overfeat_accurate(batch: int) -> tuple[nn.Module, Any, Any]:
    """OverFeat's accurate model (Sermanet et al. 2014, Table 3), 221x221, no dropout.

    The vDNN paper names convnet-benchmarks' configurations, whose OverFeat is the fast model,
    but its Fig. 4 is the accurate one's: feature maps 1176 MiB at batch 128 (accurate: 1174,
    fast: 554) and gradient maps 1080 MiB (two buffers of the largest map: accurate 1094, fast
    294); both have about 557 MiB of weights (Fig. 4: 559)."""
    model = nn.Sequential(
        nn.Conv2d(3, 96, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 3),
        nn.Conv2d(96, 256, 7, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Conv2d(256, 512, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(512, 512, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(512, 1024, 3, 1, 1), nn.ReLU(inplace=True),
        nn.Conv2d(1024, 1024, 3, 1, 1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 3),
        nn.Flatten(),
        nn.Linear(1024 * 5 * 5, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, IMAGENET_CLASSES))
    return _build(model, batch, 221)


def alexnet_caffe(batch: int) -> tuple[nn.Module, Any, Any]:
    """SuperNeurons' AlexNet (superneurons-release testing/alexnet.cpp): one tower, LRN, 227x227.
    ReLU writes its own output, as SuperNeurons' act_layer_t does (forward_setup allocates t_out;
    its backward is in place, which vsim.paper.superneurons models)."""
    model = nn.Sequential(
        nn.Conv2d(3, 96, 11, 4), nn.ReLU(), nn.LocalResponseNorm(5),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(96, 256, 5, 1, 2), nn.ReLU(), nn.LocalResponseNorm(5),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(256, 384, 3, 1, 1), nn.ReLU(),
        nn.Conv2d(384, 384, 3, 1, 1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Flatten(),
        nn.Linear(256 * 6 * 6, 4096), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(4096, IMAGENET_CLASSES))
    return _build(model, batch, 227)


class _Basic(nn.Module):
    """He et al.'s basic block: two 3x3 convs with batch norm, stride on the first, a 1x1
    projection where the shape changes (option B, as torchvision's resnet34)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet34(batch: int) -> tuple[nn.Module, Any, Any]:
    """ResNet-34 (basic blocks 3, 4, 6, 3 of 64..512 channels), 224x224."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
        for b in range(blocks):
            layers.append(_Basic(cin, width, 2 if (b == 0 and i > 0) else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, IMAGENET_CLASSES)]
    return _build(nn.Sequential(*layers), batch)
