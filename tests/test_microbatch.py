"""vsim.runtime.microbatch on the CPU: a convolution's forward and backward calls split into
micro-batches give the whole batch's results (to rounding), in either memory layout, with or
without bias, for every output mask; parts beyond the batch and keyword calls are handled."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vsim.runtime.microbatch import split_call  # noqa: E402

aten = torch.ops.aten


def _conv_args(batch: int, bias: bool, channels_last: bool, groups: int = 1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 9, 9, generator=g)
    w = torch.randn(6, 4 // groups, 3, 3, generator=g)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
        w = w.to(memory_format=torch.channels_last)
    b = torch.randn(6, generator=g) if bias else None
    return x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], groups


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_a_split_convolution_gives_the_whole_batchs_results(channels_last, bias, parts):
    args = _conv_args(5, bias, channels_last)
    whole = aten.convolution.default(*args)
    got = split_call(aten.convolution.default, args, {}, parts)
    assert got.shape == whole.shape
    assert got.is_contiguous(memory_format=torch.channels_last) == \
        whole.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, whole)
    x, w, b, stride, pad, dil, tr, opad, groups = args
    grad = torch.randn_like(whole)
    for mask in ([True, True, bias], [False, True, bias], [True, False, False]):
        bwd = (grad, x, w, [6] if bias else None, stride, pad, dil, tr, opad, groups, mask)
        want = aten.convolution_backward.default(*bwd)
        have = split_call(aten.convolution_backward.default, bwd, {}, parts)
        for a, e in zip(have, want, strict=True):
            assert (a is None) == (e is None)
            if e is not None:  # (the weight and bias gradients: a sum in another order)
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)


def test_grouped_convolutions_split_too():
    args = _conv_args(4, True, False, groups=2)
    torch.testing.assert_close(split_call(aten.convolution.default, args, {}, 2),
                               aten.convolution.default(*args))


def test_keyword_calls_and_one_part_run_as_they_are():
    args = _conv_args(4, False, False)
    whole = aten.convolution.default(*args)
    torch.testing.assert_close(split_call(aten.convolution.default, args, {}, 1), whole)
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
             "output_padding", "groups")
    kwargs = dict(zip(names, args, strict=True))
    torch.testing.assert_close(split_call(aten.convolution.default, (), kwargs, 4), whole)
