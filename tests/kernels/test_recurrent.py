"""The compiled whole-layer recurrent kernels (kernels/recurrent.c) against torch autograd.

The kernels return gate gradients; :func:`kernel_layer` does what their caller does with them (the
GEMMs of Eq. 2) so every input, state, weight and bias gradient is compared with torch's own layer.
"""

import logging

import pytest
import torch
from lightning_bppsa.kernels import _native, recurrent

from lightning_bppsa.jacobians.recurrent import gru_jacobians
from lightning_bppsa.testing import assert_derived_close

needs_kernel = pytest.mark.skipif(
    not _native.build_expected(), reason="no C compiler on PATH (or BPPSA_NATIVE=0): the kernel is not built"
)

KINDS = ("tanh", "relu", "gru", "lstm")
GATES = {"tanh": 1, "relu": 1, "gru": 3, "lstm": 4}
TORCH_LAYER = {"tanh": torch._VF.rnn_tanh, "relu": torch._VF.rnn_relu, "gru": torch._VF.gru}
NAMES = ("x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh")


@needs_kernel
def test_the_kernel_builds_where_a_compiler_exists():
    assert recurrent.available(), (
        "a C compiler is on PATH but kernels/recurrent.c did not build (see the log)"
    )


def random_layer(kind, batch, steps, hidden, dtype, inputs=5):
    """Inputs, states and parameters (torch's init range) of one layer, float64 cast to ``dtype``."""
    bound = hidden**-0.5
    g = GATES[kind] * hidden

    def uniform(*shape):
        return (torch.rand(*shape, dtype=torch.float64) * 2 - 1) * bound

    tensors = {
        "x": torch.randn(batch, steps, inputs, dtype=torch.float64),
        "h0": torch.randn(batch, hidden, dtype=torch.float64) * 0.5,
        "c0": torch.randn(batch, hidden, dtype=torch.float64) if kind == "lstm" else None,
        "w_ih": uniform(g, inputs),
        "w_hh": uniform(g, hidden),
        "b_ih": uniform(g),
        "b_hh": uniform(g),
    }
    return {k: None if v is None else v.to(dtype) for k, v in tensors.items()}


def random_grads(kind, batch, steps, hidden, dtype, last_only):
    """Upstream gradients: on every output (or the last step only) and, for LSTM, on ``c_T``."""
    grad_out = torch.randn(batch, steps, hidden, dtype=torch.float64)
    if last_only:
        grad_out[:, :-1] = 0
    grad_cn = torch.randn(batch, hidden, dtype=torch.float64) if kind == "lstm" else None
    return grad_out.to(dtype), None if grad_cn is None else grad_cn.to(dtype)


def torch_layer(kind, t, grad_out, grad_cn):
    """torch's fused layer and autograd: ``(out, {name: gradient})``."""
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if v is not None}
    weights = [leaves[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")]
    if kind == "lstm":
        hx = (leaves["h0"][None], leaves["c0"][None])
        out, _, c_n = torch._VF.lstm(leaves["x"], hx, weights, True, 1, 0.0, False, False, True)
        loss = (out * grad_out).sum() + (c_n[0] * grad_cn).sum()
    else:
        out, _ = TORCH_LAYER[kind](leaves["x"], leaves["h0"][None], weights, True, 1, 0.0, False, False, True)
        loss = (out * grad_out).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out.detach(), dict(zip(leaves, grads, strict=True))


def kernel_layer(kind, t, grad_out, grad_cn, sums=False):
    """The kernels plus their caller's GEMMs (with ``sums``: the parameter gradients the backward summed
    itself): ``(out, {name: gradient})``; ``None`` if a kernel declined."""
    x, h0, c0, w_ih, w_hh, b_ih, b_hh = (t[k] for k in NAMES)
    gi = x @ w_ih.T + b_ih
    if kind == "gru":
        forward = recurrent.gru_forward(gi, w_hh, b_hh, h0)
        if forward is None:
            return None
        out, scales, z, dn = forward
        sums = recurrent.ParameterSums(x, out, h0, True) if sums else None
        d_gi, d_gh, g0, *summed = recurrent.gru_backward(scales, z, dn, w_hh, grad_out, sums)
    elif kind == "lstm":
        out, cells, gates = recurrent.lstm_forward(gi + b_hh, w_hh, h0, c0)
        sums = recurrent.ParameterSums(x, out, h0, True) if sums else None
        d_gi, g0, gc0, *summed = recurrent.lstm_backward(gates, cells, c0, w_hh, grad_out, grad_cn, sums)
        d_gh = d_gi
    else:
        (out,) = recurrent.rnn_forward(gi + b_hh, w_hh, None, h0, kind == "relu")
        sums = recurrent.ParameterSums(x, out, h0, True) if sums else None
        d_gi, g0, *summed = recurrent.rnn_backward(out, w_hh, grad_out, kind == "relu", sums)
        d_gh = d_gi
    grads = {"x": d_gi @ w_ih, "h0": g0}
    if summed:
        grads.update(zip(("w_ih", "w_hh", "b_ih", "b_hh"), summed[0], strict=True))
    else:
        h_prev = torch.cat([h0[:, None], out[:, :-1]], 1)
        grads.update({
            "w_ih": torch.einsum("btg,bti->gi", d_gi, x),
            "w_hh": torch.einsum("btg,bth->gh", d_gh, h_prev),
            "b_ih": d_gi.sum((0, 1)),
            "b_hh": d_gh.sum((0, 1)),
        })  # fmt: skip
    if kind == "lstm":
        grads["c0"] = gc0
    return out, grads


def assert_layer_close(kind, actual, reference, baseline=None):
    (out, grads), (ref_out, ref_grads) = actual, reference
    base_out, base_grads = baseline if baseline is not None else (None, {})
    assert_derived_close(out, ref_out, base_out, name=f"{kind} out")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_derived_close(grad, ref_grads[name], base_grads.get(name), name=f"{kind} grad {name}")


@needs_kernel
@pytest.mark.parametrize("sums", [False, True], ids=["gemm", "summed"])
@pytest.mark.parametrize("last_only", [False, True], ids=["per-step", "last-step"])
@pytest.mark.parametrize("steps", [1, 2, 37])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("hidden", [1, 3, 20, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_float64_matches_torch_autograd(kind, hidden, batch, steps, last_only, sums):
    t = random_layer(kind, batch, steps, hidden, torch.float64)
    grad_out, grad_cn = random_grads(kind, batch, steps, hidden, torch.float64, last_only)
    reference = torch_layer(kind, t, grad_out, grad_cn)
    assert_layer_close(kind, kernel_layer(kind, t, grad_out, grad_cn, sums), reference)


@needs_kernel
@pytest.mark.parametrize("last_only", [False, True], ids=["per-step", "last-step"])
@pytest.mark.parametrize(("batch", "steps", "hidden"), [(1, 1, 1), (3, 2, 3), (3, 37, 20), (1, 37, 33)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sums", [False, True], ids=["gemm", "summed"])
def test_float32_within_the_error_of_torch_float32(kind, batch, steps, hidden, last_only, sums):
    t = random_layer(kind, batch, steps, hidden, torch.float64)
    grad_out, grad_cn = random_grads(kind, batch, steps, hidden, torch.float64, last_only)
    truth = torch_layer(kind, t, grad_out, grad_cn)
    t32 = {k: None if v is None else v.float() for k, v in t.items()}
    grad_out32, grad_cn32 = grad_out.float(), None if grad_cn is None else grad_cn.float()
    baseline = torch_layer(kind, t32, grad_out32, grad_cn32)
    assert_layer_close(kind, kernel_layer(kind, t32, grad_out32, grad_cn32, sums), truth, baseline)


@needs_kernel
def test_lstm_without_output_gradient():
    """``grad_out=None``: only ``c_T`` gets a gradient (and ``grad_cn=None``: only the outputs)."""
    t = random_layer("lstm", 3, 9, 5, torch.float64)
    gi = t["x"] @ t["w_ih"].T + t["b_ih"] + t["b_hh"]
    out, cells, gates = recurrent.lstm_forward(gi, t["w_hh"], t["h0"], t["c0"])
    grad_out, grad_cn = random_grads("lstm", 3, 9, 5, torch.float64, False)
    _, ref = torch_layer("lstm", t, torch.zeros_like(grad_out), grad_cn)
    d_gates, gh0, gc0 = recurrent.lstm_backward(gates, cells, t["c0"], t["w_hh"], None, grad_cn)
    assert_derived_close(gh0, ref["h0"])
    assert_derived_close(gc0, ref["c0"])
    assert_derived_close(d_gates.sum((0, 1)), ref["b_hh"])
    _, ref = torch_layer("lstm", t, grad_out, torch.zeros_like(grad_cn))
    d_gates, gh0, gc0 = recurrent.lstm_backward(gates, cells, t["c0"], t["w_hh"], grad_out, None)
    assert_derived_close(gh0, ref["h0"])
    assert_derived_close(gc0, ref["c0"])


@needs_kernel
def test_forward_factors_are_the_jacobian_modules_factors():
    """The GRU's ``scales, z`` are ``gru_jacobians``' chain; the RNN stores no factor."""
    t = random_layer("gru", 3, 11, 7, torch.float64)
    h_prev_of = lambda out: torch.cat([t["h0"][:, None], out[:, :-1]], 1)  # noqa: E731
    out, scales, z, dn = recurrent.gru_forward(
        t["x"] @ t["w_ih"].T + t["b_ih"], t["w_hh"], t["b_hh"], t["h0"]
    )
    jac, local = gru_jacobians(t["x"], h_prev_of(out), t["w_ih"], t["w_hh"], t["b_ih"], t["b_hh"])
    torch.testing.assert_close(scales, jac.scales, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(z, jac.diagonal, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dn, local[..., 2 * 7 :], rtol=1e-12, atol=1e-14)
    t = random_layer("tanh", 3, 11, 7, torch.float64)
    assert len(recurrent.rnn_forward(t["x"] @ t["w_ih"].T + t["b_ih"], t["w_hh"], t["b_hh"], t["h0"], False)) == 1


@needs_kernel
def test_relu_nan_semantics_match_torch():
    """Forward: relu keeps a NaN (as torch's layer does). Backward: the gradient passes where NOT
    ``out <= 0``, NaN included, and a NaN upstream gradient becomes 0 where ``out <= 0`` (a select, not a
    product: torch's ``threshold_backward``)."""
    t = random_layer("relu", 3, 8, 6, torch.float64)
    t["x"][1, 5, 0] = float("nan")  # every gate of row 1 from step 5 on is NaN
    weights = [t[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh")]
    ref, _ = torch._VF.rnn_relu(t["x"], t["h0"][None], weights, True, 1, 0.0, False, False, True)
    (out,) = recurrent.rnn_forward(t["x"] @ t["w_ih"].T + t["b_ih"] + t["b_hh"], t["w_hh"], None, t["h0"], True)
    assert out[1, 5:].isnan().all() and not out[[0, 2]].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True)
    grad_out = torch.randn_like(out)
    grad_out[:, -1] = float("nan")
    d_a, _ = recurrent.rnn_backward(out, t["w_hh"], grad_out, True)
    assert (out[:, -1] <= 0).any() and (out[:, -1] > 0).any()  # both cases occur
    expected = torch.ops.aten.threshold_backward(grad_out[:, -1], out[:, -1], 0)
    torch.testing.assert_close(d_a[:, -1], expected, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [9, 20])
@pytest.mark.parametrize("batch", [3, 6, 7, 10])
def test_two_threads_give_the_same_bits(monkeypatch, kind, batch, hidden):
    """Rows split over threads (3 rows on 2 threads: uneven; 6: three pairs; 7 and 10: the rows grouped
    by four differently on one and two threads) compute exactly what one thread does, the parameter
    gradients summed in the sweep included."""
    t = random_layer(kind, batch, 20, hidden, torch.float32)
    grad_out, grad_cn = random_grads(kind, batch, 20, hidden, torch.float32, False)
    monkeypatch.setattr(_native, "threads", lambda batch: 1)  # not torch's count: another test may have set it
    one = kernel_layer(kind, t, grad_out, grad_cn, sums=True)
    monkeypatch.setattr(_native, "threads", lambda batch: 2)
    two = kernel_layer(kind, t, grad_out, grad_cn, sums=True)
    assert torch.equal(one[0], two[0]) and all(torch.equal(one[1][k], two[1][k]) for k in one[1])


@needs_kernel
def test_non_contiguous_inputs():
    t = random_layer("gru", 3, 6, 4, torch.float64)
    gi = (t["x"] @ t["w_ih"].T + t["b_ih"]).transpose(0, 1).contiguous().transpose(0, 1)
    w_hh = t["w_hh"].T.contiguous().T
    assert not gi.is_contiguous() and not w_hh.is_contiguous()
    expected = recurrent.gru_forward(gi.contiguous(), w_hh.contiguous(), t["b_hh"], t["h0"])
    for got, want in zip(recurrent.gru_forward(gi, w_hh, t["b_hh"], t["h0"]), expected, strict=True):
        assert torch.equal(got, want)


@needs_kernel
def test_denormal_mode_of_the_caller_is_restored():
    torch.set_flush_denormal(False)
    t = random_layer("tanh", 2, 5, 4, torch.float32)
    recurrent.rnn_forward(t["x"] @ t["w_ih"].T, t["w_hh"], None, t["h0"], False)
    assert (torch.tensor(1e-39) * 1.0).item() != 0, "the kernel left flush-to-zero on in the calling thread"


@needs_kernel
@pytest.mark.parametrize(("batch", "steps"), [(0, 4), (2, 0)])
def test_empty_batch_or_sequence(batch, steps):
    t = random_layer("lstm", batch, steps, 3, torch.float64)
    gi = t["x"] @ t["w_ih"].T
    out, cells, gates = recurrent.lstm_forward(gi, t["w_hh"], t["h0"], t["c0"])
    assert out.shape == cells.shape == (batch, steps, 3) and gates.shape == (batch, steps, 12)
    grad_cn = torch.randn(batch, 3, dtype=torch.float64)
    d_gates, gh0, gc0 = recurrent.lstm_backward(
        gates, cells, t["c0"], t["w_hh"], torch.zeros_like(out), grad_cn
    )
    assert d_gates.shape == gates.shape and gh0.shape == gc0.shape == (batch, 3)
    if steps == 0:  # nothing to go through: the gradients reach h_0 and c_0 unchanged
        assert not gh0.any() and torch.equal(gc0, grad_cn)


@needs_kernel
def test_declines_what_it_does_not_handle():
    t = random_layer("tanh", 2, 3, 4, torch.float64)
    gi, w, h0 = t["x"] @ t["w_ih"].T, t["w_hh"], t["h0"]
    assert recurrent.rnn_forward(gi.half(), w.half(), None, h0.half(), False) is None
    assert recurrent.rnn_forward(gi.long(), w.long(), None, h0.long(), False) is None
    assert recurrent.rnn_forward(gi.float(), w, None, h0, False) is None  # mixed dtypes
    assert recurrent.rnn_forward(gi.to("meta"), w.to("meta"), None, h0.to("meta"), False) is None
    assert recurrent.gru_backward(*(torch.ones(2, 3, n, device="meta") for n in (12, 4, 4)),
                                  torch.ones(12, 4, device="meta"), torch.ones(2, 3, 4, device="meta")) is None  # fmt: skip
    assert recurrent.fast_tanh(torch.ones(3, dtype=torch.float64)) is None


def test_bad_shapes_name_the_argument():
    gi, h0 = torch.zeros(2, 3, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"w_hh must have shape \(4, 4\), got \(4, 5\)"):
        recurrent.rnn_forward(gi, torch.zeros(4, 5), None, h0, False)
    with pytest.raises(ValueError, match=r"gi must have shape \(B, T, 3 H\)"):
        recurrent.gru_forward(gi, torch.zeros(12, 4), None, h0)
    with pytest.raises(ValueError, match=r"grad_cn must have shape \(2, 1\)"):
        recurrent.lstm_backward(gi, torch.zeros(2, 3, 1), h0[:, :1], torch.zeros(4, 1), None, torch.zeros(2))


# float32 activations: ulps against float64, on every magnitude that matters
TANH_MAX_ULP, SIGMOID_MAX_ULP = 1.5, 2.5  # measured 1.37 and 2.46 (kernels/recurrent.c)


def ulp_error(approx, truth):
    """Errors in units of the float32 spacing at the correctly rounded result, where that is normal."""
    rounded = truth.float().abs()
    spacing = (torch.nextafter(rounded, torch.tensor(float("inf"))) - rounded).double()
    normal = rounded >= torch.finfo(torch.float32).tiny
    return ((approx.double() - truth).abs() / spacing)[normal]


def dense_grid():
    small = torch.logspace(-30, 0, 200_001, dtype=torch.float64)
    return torch.cat([torch.linspace(-30, 30, 2_000_001, dtype=torch.float64), small, -small]).float()


@needs_kernel
def test_float32_tanh_error_is_a_few_ulp():
    x = dense_grid()
    error = ulp_error(recurrent.fast_tanh(x), torch.tanh(x.double()))
    assert error.max() <= TANH_MAX_ULP, f"max error {error.max():.2f} ulp"
    special = recurrent.fast_tanh(torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]))
    assert special[0].isnan() and special[1] == 1 and special[2] == -1 and special[3].signbit()


@needs_kernel
def test_float32_sigmoid_error_is_a_few_ulp():
    x = dense_grid()
    error = ulp_error(recurrent.fast_sigmoid(x), torch.sigmoid(x.double()))
    assert error.max() <= SIGMOID_MAX_ULP, f"max error {error.max():.2f} ulp"
    special = recurrent.fast_sigmoid(torch.tensor([float("nan"), float("inf"), -float("inf")]))
    assert special[0].isnan() and special[1] == 1 and special[2] == 0


# a build that fails (or is switched off) falls back: every function returns None, one log line says why


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    monkeypatch.setenv("BPPSA_CACHE_DIR", str(tmp_path))
    recurrent._LIBRARY.reset()
    yield tmp_path
    recurrent._LIBRARY.reset()


def test_failed_build_falls_back_with_one_warning(monkeypatch, fresh_state, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="lightning_bppsa.kernels.recurrent"):
        assert (
            recurrent.rnn_forward(torch.zeros(1, 2, 3), torch.zeros(3, 3), None, torch.zeros(1, 3), False)
            is None
        )
        assert not recurrent.available()
    assert caplog.text.count("could not build") == 1 and "recurrent.c" in caplog.text
    assert "exited with status 1" in caplog.text and "torch code instead" in caplog.text
    assert not list(fresh_state.glob("*.so"))


def test_disabled_by_environment(monkeypatch, fresh_state, caplog):
    monkeypatch.setenv("BPPSA_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="lightning_bppsa.kernels.recurrent"):
        assert recurrent.gru_forward(torch.zeros(1, 2, 6), torch.zeros(6, 2), None, torch.zeros(1, 2)) is None
    assert "BPPSA_NATIVE=0" in caplog.text


@needs_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_projecting_its_inputs_equals_the_given_projection(kind, bias):
    """A forward given x and W_ih (a Projection) computes what it computes from gi = x W_ihᵀ + b."""
    t = random_layer(kind, 3, 9, 6, torch.float64, inputs=4)
    b_in = (t["b_ih"] + (0 if kind == "gru" else t["b_hh"])) if bias else None
    gi = t["x"] @ t["w_ih"].T + (0 if b_in is None else b_in)
    projection = recurrent.Projection(t["x"], t["w_ih"], b_in)
    if kind == "gru":
        pairs = [recurrent.gru_forward(g, t["w_hh"], t["b_hh"], t["h0"]) for g in (gi, projection)]
    elif kind == "lstm":
        pairs = [recurrent.lstm_forward(g, t["w_hh"], t["h0"], t["c0"]) for g in (gi, projection)]
    else:
        pairs = [recurrent.rnn_forward(g, t["w_hh"], None, t["h0"], kind == "relu") for g in (gi, projection)]
    for given, projected in zip(*pairs, strict=True):
        torch.testing.assert_close(projected, given, rtol=1e-12, atol=1e-12)


@needs_kernel
def test_projection_with_mismatched_shapes_names_the_argument():
    x, w_hh, h0 = torch.zeros(2, 3, 4), torch.zeros(5, 5), torch.zeros(2, 5)
    with pytest.raises(ValueError, match="w_ih"):
        recurrent.rnn_forward(recurrent.Projection(x, torch.zeros(5, 3), None), w_hh, None, h0, False)
    with pytest.raises(ValueError, match="bias"):
        recurrent.rnn_forward(recurrent.Projection(x, torch.zeros(5, 4), torch.zeros(4)), w_hh, None, h0, False)
