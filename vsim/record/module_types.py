"""The layer-type vocabulary of traces (conv, fc, relu, pool, bn, ...) for PyTorch module
classes: a layer's type is its module's, found by class name along the class's bases."""

from __future__ import annotations

from torch import nn

_MODULE_TYPES = {
    "Conv1d": "conv", "Conv2d": "conv", "Conv3d": "conv", "ConvTranspose1d": "conv",
    "ConvTranspose2d": "conv", "ConvTranspose3d": "conv",
    "Linear": "fc", "Bilinear": "fc",
    "ReLU": "relu", "ReLU6": "relu", "LeakyReLU": "relu", "PReLU": "relu", "ELU": "relu",
    "Threshold": "relu", "Hardtanh": "relu", "SiLU": "relu",
    "MaxPool1d": "pool", "MaxPool2d": "pool", "MaxPool3d": "pool", "AvgPool1d": "pool",
    "AvgPool2d": "pool", "AvgPool3d": "pool", "AdaptiveAvgPool1d": "pool",
    "AdaptiveAvgPool2d": "pool", "AdaptiveAvgPool3d": "pool", "AdaptiveMaxPool2d": "pool",
    "BatchNorm1d": "bn", "BatchNorm2d": "bn", "BatchNorm3d": "bn", "SyncBatchNorm": "bn",
    "GroupNorm": "bn", "InstanceNorm2d": "bn",
    "LocalResponseNorm": "lrn",
    "Dropout": "dropout", "Dropout1d": "dropout", "Dropout2d": "dropout", "Dropout3d": "dropout",
    "LayerNorm": "layernorm", "RMSNorm": "layernorm",
    "Embedding": "embedding", "EmbeddingBag": "embedding",
    "GELU": "gelu", "Softmax": "softmax", "LogSoftmax": "softmax", "Softmax2d": "softmax",
    "MultiheadAttention": "attention",
    "_Loss": "loss",
}


def module_type(module: nn.Module) -> str:
    """The layer-type vocabulary word for a module class (or a base class), else 'other'."""
    for cls in type(module).__mro__:
        kind = _MODULE_TYPES.get(cls.__name__)
        if kind:
            return kind
    return "other"
