"""Every analytic transposed Jacobian equals autograd's (transposed, densified), float64, exactly."""

import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_bppsa.jacobians import (
    BatchedCSR,
    is_supported,
    linearize,
    output_dims,
    refusal,
    transposed_jacobian,
)


def autograd_jt(module, x):
    """(∂y/∂x)ᵀ by torch.autograd.functional.jacobian: (x.numel(), y.numel())."""
    jac = torch.autograd.functional.jacobian(module, x)
    return jac.reshape(-1, x.numel()).T


def check(module, sample_shape, atol=1e-12, batched_forward=False):
    """``batched_forward``: the module only accepts batches (BatchNorm2d), so autograd sees one."""
    module = module.double()
    x = torch.randn(*sample_shape, dtype=torch.float64)
    jt = transposed_jacobian(module, x)
    assert jt.layout == torch.sparse_csr
    expected = autograd_jt((lambda s: module(s[None])[0]) if batched_forward else module, x)
    assert jt.shape == expected.shape
    torch.testing.assert_close(jt.to_dense(), expected, atol=atol, rtol=0)


def randomised(module):
    """Random non-trivial weights (and running statistics) so no entry is accidentally special."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        for name in ("running_mean", "running_var"):
            if hasattr(module, name) and getattr(module, name) is not None:
                getattr(module, name).uniform_(0.5, 2.0)
    return module


CONV = [
    # (in, out, kernel, stride, padding, dilation, groups, bias, (H, W))
    (3, 4, 3, 1, 1, 1, 1, True, (5, 6)),
    (2, 3, 1, 1, 0, 1, 1, False, (4, 4)),
    (2, 2, (2, 3), (2, 1), (1, 0), 1, 1, True, (7, 5)),
    (4, 6, 3, 2, "valid", 1, 2, True, (6, 7)),
    (2, 4, 3, 1, "same", 2, 1, True, (5, 5)),
    (2, 3, (2, 4), 1, "same", 1, 1, False, (5, 6)),  # even kernel: torch pads more after
    (3, 3, 3, 3, 2, (2, 1), 3, True, (9, 8)),  # depthwise, padding > stride
    (1, 2, 5, 1, 0, 1, 1, True, (5, 5)),  # kernel covers the image
]


@pytest.mark.parametrize("cfg", CONV, ids=str)
def test_conv2d(cfg):
    ci, co, k, s, p, d, g, bias, hw = cfg
    check(randomised(nn.Conv2d(ci, co, k, s, p, d, g, bias)), (ci, *hw))


def test_conv2d_pruned_weights_leave_the_pattern():
    conv = randomised(nn.Conv2d(3, 4, 3, padding=1)).double()
    x = torch.randn(3, 6, 6, dtype=torch.float64)
    full = transposed_jacobian(conv, x)
    with torch.no_grad():
        conv.weight[torch.rand_like(conv.weight) < 0.7] = 0
    pruned = transposed_jacobian(conv, x)
    assert pruned._nnz() < full._nnz()
    torch.testing.assert_close(pruned.to_dense(), autograd_jt(conv, x), atol=1e-12, rtol=0)


POOL = [
    # (kernel, stride, padding, dilation, ceil_mode, (C, H, W))
    (2, None, 0, 1, False, (3, 6, 6)),
    (3, 2, 1, 1, False, (2, 7, 5)),
    ((2, 3), (1, 2), (1, 1), 1, True, (2, 5, 7)),
    (2, 1, 0, 2, False, (1, 6, 6)),
    (3, 3, 0, 1, True, (2, 8, 7)),
]


@pytest.mark.parametrize("cfg", POOL, ids=str)
def test_maxpool2d(cfg):
    k, s, p, d, ceil, shape = cfg
    check(nn.MaxPool2d(k, s, p, d, ceil_mode=ceil), shape)


@pytest.mark.parametrize("cfg", POOL, ids=str)
@pytest.mark.parametrize("include_pad", [True, False])
def test_avgpool2d(cfg, include_pad):
    k, s, p, _, ceil, shape = cfg
    check(nn.AvgPool2d(k, s, p, ceil_mode=ceil, count_include_pad=include_pad), shape)


def test_avgpool2d_divisor_override():
    check(nn.AvgPool2d(3, 2, 1, divisor_override=5), (2, 6, 5))


POINTWISE = [nn.ReLU(), nn.LeakyReLU(0.2), nn.Tanh(), nn.Sigmoid(), nn.Dropout(0.3).eval()]


@pytest.mark.parametrize("module", POINTWISE, ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("shape", [(1,), (7,), (2, 3, 5)], ids=str)
def test_pointwise(module, shape):
    check(module, shape)


def test_flatten():
    check(nn.Flatten(), (2, 3, 5))


def test_relu_at_zero_matches_autograd():
    x = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(transposed_jacobian(nn.ReLU(), x).to_dense(), autograd_jt(nn.ReLU(), x))


def test_dropout_train_mask_matches_the_forward_on_the_same_seed():
    dropout = nn.Dropout(0.4).train()
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.manual_seed(7)
    jt = transposed_jacobian(dropout, x).to_dense()
    torch.manual_seed(7)
    expected = autograd_jt(dropout, x)
    assert 0 < int((expected.diagonal() == 0).sum()) < x.numel()  # a mask that drops some, keeps some
    torch.testing.assert_close(jt, expected, atol=0, rtol=0)


def test_dropout_linearize_output_agrees_with_its_jacobian():
    x = torch.randn(3, 10, dtype=torch.float64)
    y, jac = linearize(nn.Dropout(0.5).train(), x)
    torch.testing.assert_close(y, x * jac.values)


@pytest.mark.parametrize("affine", [True, False])
def test_batchnorm2d_eval(affine):
    check(randomised(nn.BatchNorm2d(3, affine=affine)).eval(), (3, 4, 5), batched_forward=True)


@pytest.mark.parametrize("cfg", [(5, 3, True, (5,)), (4, 1, False, (4,)), (3, 6, True, (2, 3))], ids=str)
def test_linear(cfg):
    fan_in, fan_out, bias, shape = cfg
    check(randomised(nn.Linear(fan_in, fan_out, bias)), shape)


def test_batched_values_match_per_sample_jacobians():
    relu, pool = nn.ReLU(), nn.MaxPool2d(2)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    for module in (relu, pool):
        _, jac = linearize(module, x)
        assert isinstance(jac, BatchedCSR) and jac.values.shape[0] == 3
        for b in range(3):
            torch.testing.assert_close(jac.to_dense()[b], autograd_jt(module, x[b]))


def test_pattern_is_cached_per_layer_and_shape():
    conv = nn.Conv2d(2, 3, 3).double()
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    first = linearize(conv, x)[1].pattern
    assert linearize(conv, torch.randn_like(x))[1].pattern is first
    assert linearize(conv, torch.randn(1, 2, 7, 6, dtype=torch.float64))[1].pattern is not first
    relu = [linearize(nn.ReLU(), torch.randn(2, 5))[1].pattern for _ in range(2)]
    assert relu[0] is relu[1]


def test_pooling_layers_with_one_window_share_its_pattern():
    # the cache key is the normalised window geometry: 2, (2, 2), stride None or 2 all name the same one
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    patterns = [
        linearize(module, x)[1].pattern
        for module in (
            nn.MaxPool2d(2),
            nn.AvgPool2d((2, 2), stride=2),
            nn.MaxPool2d((2, 2), stride=(2, 2), dilation=1),
        )
    ]
    assert patterns[0] is patterns[1] is patterns[2]
    assert linearize(nn.MaxPool2d(2, stride=1), x)[1].pattern is not patterns[0]


def test_unsupported_module_is_named():
    assert not is_supported(nn.GELU())
    with pytest.raises(NotImplementedError, match="GELU"):
        transposed_jacobian(nn.GELU(), torch.randn(3))


@pytest.mark.parametrize(
    "module",
    [nn.BatchNorm2d(2).train(), nn.BatchNorm2d(2, track_running_stats=False).eval()],
    ids=["training", "no-running-stats"],
)
def test_batchnorm_with_batch_statistics_is_refused(module):
    assert "couples the samples" in refusal(module)
    with pytest.raises(NotImplementedError, match="training mode or without running statistics"):
        transposed_jacobian(module, torch.randn(2, 3, 3))


def test_refusal_and_output_dims_answer_before_anything_runs():
    assert refusal(nn.Conv2d(1, 1, 3)) is None and "GELU" in refusal(nn.GELU())
    assert "return_indices" in refusal(nn.MaxPool2d(2, return_indices=True))
    assert output_dims(nn.Conv2d(1, 1, 3), 4) == 4 and output_dims(nn.Conv2d(1, 1, 3), 3) is None
    assert output_dims(nn.Linear(2, 2), 3) == 3 and output_dims(nn.Linear(2, 2), 1) is None
    assert output_dims(nn.Flatten(), 4) == 2 and output_dims(nn.Flatten(2, 3), 5) == 4
    assert output_dims(nn.Flatten(0), 4) is None  # merges the batch
    assert output_dims(nn.ReLU(), 1) == 1 and output_dims(nn.GELU(), 2) is None


# input torch's forward rejects: torch's own error type and message, before any Jacobian is built
BAD_INPUTS = {
    "conv 5-D": (nn.Conv2d(1, 2, 3), (2, 1, 1, 5, 5)),
    "maxpool kernel > input": (nn.MaxPool2d(4), (2, 1, 2, 2)),
    "maxpool 5-D": (nn.MaxPool2d(2), (2, 1, 1, 4, 4)),
    "avgpool 2-D": (nn.AvgPool2d(2), (2, 4)),
    "batchnorm channels": (nn.BatchNorm2d(3).eval(), (2, 2, 3, 3)),
    "linear features": (nn.Linear(3, 2), (2, 4)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_torchs_own_error(case):
    module, shape = BAD_INPUTS[case]
    x = torch.randn(shape)
    with pytest.raises(Exception) as expected:
        module(x)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        linearize(module, x)


def test_input_torch_takes_unbatched_is_refused_as_a_batch():
    with pytest.raises(ValueError, match=r"not as a batch"):
        linearize(nn.Conv2d(1, 2, 3), torch.randn(1, 5, 5))


def test_relu_jacobian_passes_nan_outputs_like_threshold_backward():
    x = torch.tensor([1.0, -2.0, float("nan"), 0.0], dtype=torch.float64)
    expected = autograd_jt(nn.ReLU(), x)
    torch.testing.assert_close(transposed_jacobian(nn.ReLU(), x).to_dense(), expected, equal_nan=True)
    assert transposed_jacobian(nn.ReLU(), x).to_dense()[2, 2] == 1


def test_conv_padding_mode_is_refused():
    with pytest.raises(NotImplementedError, match="padding_mode"):
        transposed_jacobian(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), torch.randn(1, 4, 4))


def test_x_must_be_a_tensor():
    with pytest.raises(TypeError, match="x must be a Tensor"):
        transposed_jacobian(nn.ReLU(), [1.0])


@settings(max_examples=20, deadline=None)
@given(
    groups=st.integers(1, 2),
    per_group=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    hw=st.tuples(st.integers(1, 7), st.integers(1, 7)),
)
def test_conv2d_fuzzed(groups, per_group, kernel, stride, padding, dilation, hw):
    extent = [d * (k - 1) + 1 for d, k in zip(dilation, kernel, strict=True)]
    assume(all(h + 2 * p >= e for h, p, e in zip(hw, padding, extent, strict=True)))
    conv = nn.Conv2d(groups * per_group[0], groups * per_group[1], kernel, stride, padding, dilation, groups)
    check(randomised(conv), (groups * per_group[0], *hw))


@settings(max_examples=15, deadline=None)
@given(
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.integers(1, 2),
    ceil_mode=st.booleans(),
    hw=st.tuples(st.integers(3, 7), st.integers(3, 7)),
)
def test_maxpool2d_fuzzed(kernel, stride, dilation, ceil_mode, hw):
    padding = (kernel[0] // 2, kernel[1] // 2)  # torch allows at most half the kernel
    check(nn.MaxPool2d(kernel, stride, padding, dilation, ceil_mode=ceil_mode), (2, *hw))
