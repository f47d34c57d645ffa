"""Convolutions run as micro-batches: a plan's Retime with parts > 1 (vsim.workspace_free.
microbatch_retime; `algo=microbatch`, `vsim search`).

cuDNN's workspace grows with the batch, so a convolution whose workspace cannot be had runs as
`parts` calls on slices of its batch, each with its recorded algorithm and a part of the
workspace, instead of without one (4-5x slower on VGG-16's first layers). The forward call's
result is assembled in one tensor of the whole batch (each part's result copied into place);
the backward call's input gradient likewise, its weight and bias gradients summed over the
parts (the same sum in another order: not bitwise equal to the whole-batch call). The calls
are made below the op tracker, so they are not counted; a recomputation replays them split too.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
SPLITTABLE = (aten.convolution.default, aten.convolution_backward.default)


def splits(func: Any, kwargs: Any) -> bool:
    """Whether `split_call` splits this call: a convolution's forward or backward call with
    positional arguments (the dispatch mode's and the replay's calls)."""
    return func in SPLITTABLE and not kwargs


def split_call(func: Any, args: Any, kwargs: Any, parts: int) -> Any:
    """`func(*args, **kwargs)` with its batch in `parts` micro-batches where `func` is a
    convolution's forward or backward call with positional arguments (`splits`); the call as
    it is otherwise."""
    if not splits(func, kwargs) or parts < 2:
        return func(*args, **kwargs)
    if func is aten.convolution.default:
        return _forward(func, args, parts)
    return _backward(func, args, parts)


def _whole(first: torch.Tensor, batch: int) -> torch.Tensor:
    """An empty tensor like `first` (one part's result) for the whole batch, in its layout."""
    fmt = torch.channels_last if (first.dim() == 4 and not first.is_contiguous()
                                  and first.is_contiguous(memory_format=torch.channels_last)) \
        else torch.contiguous_format
    return torch.empty((batch, *first.shape[1:]), dtype=first.dtype, device=first.device,
                       memory_format=fmt)


def _forward(func: Any, args: Any, parts: int) -> torch.Tensor:
    x, rest = args[0], args[1:]
    out: torch.Tensor | None = None
    at = 0
    for part in x.tensor_split(parts, dim=0):
        n = part.shape[0]
        if n == 0:
            continue
        y = func(part, *rest)
        if out is None:
            out = _whole(y, x.shape[0])
        out[at:at + n].copy_(y)
        at += n
        del y  # its memory back before the next part's
    assert out is not None
    return out


def _backward(func: Any, args: Any, parts: int) -> tuple[Any, Any, Any]:
    grad_out, x, rest = args[0], args[1], args[2:]
    g_in: torch.Tensor | None = None
    g_w: torch.Tensor | None = None
    g_b: torch.Tensor | None = None
    at = 0
    for go, part in zip(grad_out.tensor_split(parts, dim=0), x.tensor_split(parts, dim=0),
                        strict=True):
        n = part.shape[0]
        if n == 0:
            continue
        gi, gw, gb = func(go, part, *rest)
        if gi is not None:
            if g_in is None:
                g_in = _whole(gi, x.shape[0])
            g_in[at:at + n].copy_(gi)
        if gw is not None:
            g_w = gw if g_w is None else g_w.add_(gw)
        if gb is not None:
            g_b = gb if g_b is None else g_b.add_(gb)
        at += n
        del gi, gw, gb
    return g_in, g_w, g_b
