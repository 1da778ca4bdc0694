"""nn.RNN / GRU / LSTM: gradients equal torch autograd on the torch module with the same weights."""

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_bppsa import nn as bnn
from lightning_bppsa.nn import convert, reference_backward
from lightning_bppsa.testing import assert_derived_close

PAIRS = {"RNN": (bnn.RNN, nn.RNN), "GRU": (bnn.GRU, nn.GRU), "LSTM": (bnn.LSTM, nn.LSTM)}


def _loss(output, h_n, where, time_dim):
    """A non-trivial loss reading the last step, every step, or h_n (and c_n for LSTM)."""
    h, c = h_n if isinstance(h_n, tuple) else (h_n, None)
    if where == "last":
        return (output.select(time_dim, -1) ** 2).sum()
    if where == "every":
        return (output**2).sum() + output.sum()
    return (h**2).sum() + (0.0 if c is None else c.sin().sum())


def _grads(module, x, hx, where):
    time_dim = 1 if module.batch_first and x.dim() == 3 else 0
    leaves = [x] + ([] if hx is None else list(hx) if isinstance(hx, tuple) else [hx])
    for t in leaves:
        t.grad = None
    module.zero_grad(set_to_none=True)
    output, h_n = module(x, hx)
    _loss(output, h_n, where, time_dim).backward()
    return [t.grad for t in leaves] + [p.grad for p in module.parameters()]


def _check(
    cell,
    *,
    layers=1,
    bidirectional=False,
    bias=True,
    batch_first=True,
    batch=3,
    length=7,
    inputs=4,
    hidden=5,
    where="every",
    dtype=torch.float64,
    with_hx=True,
    unbatched=False,
    algorithm="chunked",
):
    ours_cls, torch_cls = PAIRS[cell]
    kw = dict(num_layers=layers, bidirectional=bidirectional, bias=bias, batch_first=batch_first)
    ours = ours_cls(inputs, hidden, algorithm=algorithm, dtype=torch.float64, **kw)
    ref = torch_cls(inputs, hidden, dtype=torch.float64, **kw)
    ref.load_state_dict(ours.state_dict())
    shape = (
        (length, inputs)
        if unbatched
        else ((batch, length, inputs) if batch_first else (length, batch, inputs))
    )
    x64 = torch.randn(shape, dtype=torch.float64)
    state_shape = (layers * (2 if bidirectional else 1),) + (() if unbatched else (batch,)) + (hidden,)
    hx64 = None
    if with_hx:
        hx64 = torch.randn(state_shape, dtype=torch.float64) * 0.5
        if cell == "LSTM":
            hx64 = (hx64, torch.randn(state_shape, dtype=torch.float64))

    def leaf(t, dt):
        return (
            None
            if t is None
            else (
                tuple(leaf(s, dt) for s in t) if isinstance(t, tuple) else t.detach().to(dt).requires_grad_()
            )
        )

    truth = _grads(ref, leaf(x64, torch.float64), leaf(hx64, torch.float64), where)
    ours.to(dtype)
    ref.to(dtype)
    actual = _grads(ours, leaf(x64, dtype), leaf(hx64, dtype), where)
    baseline = _grads(ref, leaf(x64, dtype), leaf(hx64, dtype), where) if dtype != torch.float64 else None
    if algorithm != "auto":
        assert ours.last_stats["path"] == "scan"
    for i, (a, r) in enumerate(zip(actual, truth, strict=True)):
        b = None if baseline is None else baseline[i]
        floor = 1e-9 if dtype == torch.float64 else 1e-4
        assert_derived_close(a, r, b, floor=floor, name=f"{cell} grad #{i}")


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 33])
@pytest.mark.parametrize("where", ["last", "every", "h_n"])
def test_named_lengths_float64(cell, length, where):
    _check(cell, length=length, where=where)


# named configurations: only what differs from _check's defaults (B=3, T=7, 4 -> 5, float64, chunked)
NAMED_CASES = {
    **{
        f"stack-bidirectional-no-bias-time-major-{algorithm}": dict(
            layers=3,
            bidirectional=True,
            bias=False,
            batch_first=False,
            batch=2,
            length=17,
            inputs=3,
            hidden=4,
            algorithm=algorithm,
        )
        for algorithm in ("linear", "blelloch", "chunked")
    },
    "float32-long-sequence": dict(
        batch=4, length=513, inputs=3, hidden=20, where="last", dtype=torch.float32
    ),
    "unbatched-without-initial-state": dict(
        layers=2,
        bidirectional=True,
        batch_first=False,
        batch=1,
        length=5,
        inputs=2,
        hidden=3,
        where="h_n",
        with_hx=False,
        unbatched=True,
        algorithm="blelloch",
    ),
}


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c.startswith("float32-long") else c for c in NAMED_CASES],
)
def test_named_configurations(cell, case):
    _check(cell, **NAMED_CASES[case])


def test_relu_nonlinearity():
    ours = bnn.RNN(3, 4, nonlinearity="relu", algorithm="chunked", dtype=torch.float64)
    ref = nn.RNN(3, 4, nonlinearity="relu", dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(9, 2, 3, dtype=torch.float64, requires_grad=True)
    a, b = _grads(ours, x, None, "every"), _grads(ref, x, None, "every")
    for ga, gb in zip(a, b, strict=True):
        assert_derived_close(ga, gb, floor=1e-9)


FUZZ_CONFIGS = st.fixed_dictionaries(
    {
        "layers": st.integers(1, 2),
        "bidirectional": st.booleans(),
        "bias": st.booleans(),
        "batch_first": st.booleans(),
        "batch": st.integers(1, 64),
        "length": st.one_of(st.integers(1, 40), st.sampled_from([255, 257, 3000])),
        "inputs": st.integers(1, 128),
        "hidden": st.integers(1, 128),
        "where": st.sampled_from(["last", "every", "h_n"]),
        "dtype": st.sampled_from([torch.float64, torch.float32]),
    }
)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cell=st.sampled_from(list(PAIRS)), config=FUZZ_CONFIGS)
def test_fuzz_against_torch(cell, config):
    # keep each example small in total work: long sequences only with small batch and width
    if config["length"] > 40:
        config.update(
            batch=min(config["batch"], 2),
            inputs=min(config["inputs"], 8),
            hidden=min(config["hidden"], 8),
            layers=1,
            bidirectional=False,
        )
    elif config["batch"] * config["hidden"] > 512:
        config["hidden"] = max(1, 512 // config["batch"])
    _check(cell, **config)


def test_dropout_between_layers_uses_the_forward_mask():
    ours = bnn.GRU(3, 4, num_layers=2, dropout=0.5, algorithm="chunked", dtype=torch.float64)
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    output, _ = ours(x)
    scan = torch.autograd.grad(output.sum(), [x, *ours.parameters()], retain_graph=True)
    with reference_backward():
        auto = torch.autograd.grad(output.sum(), [x, *ours.parameters()])
    for a, b in zip(scan, auto, strict=True):
        assert_derived_close(a, b, floor=1e-9)


@pytest.mark.parametrize("cell", list(PAIRS))
def test_reference_backward_matches_scan_on_the_same_graph(cell):
    ours = PAIRS[cell][0](3, 5, algorithm="chunked", dtype=torch.float64)
    x = torch.randn(2, 11, 3, dtype=torch.float64, requires_grad=True)
    output, _ = ours(x)
    loss = (output**2).sum()
    scan = torch.autograd.grad(loss, [x, *ours.parameters()], retain_graph=True)
    assert ours.last_stats["scan_seconds"] > 0
    assert ours.last_stats["scan_algorithm"].startswith("chunked(c=")  # forced chunked really chunks
    with reference_backward():
        auto = torch.autograd.grad(loss, [x, *ours.parameters()])
    for a, b in zip(scan, auto, strict=True):
        assert_derived_close(a, b, floor=1e-9)


@pytest.mark.parametrize("cell", list(PAIRS))
def test_convert_keeps_parameters_and_state_dict(cell):
    ours_cls, torch_cls = PAIRS[cell]
    model = nn.Sequential(torch_cls(3, 4, num_layers=2, bidirectional=True))
    before = list(model[0].parameters())
    names = [n for n, _ in model.named_parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model)
    assert type(model[0]) is ours_cls
    assert all(a is b for a, b in zip(model.parameters(), before, strict=True))
    assert [n for n, _ in model.named_parameters()] == names
    plain = nn.Sequential(torch_cls(3, 4, num_layers=2, bidirectional=True))
    plain.load_state_dict(model.state_dict())
    model.load_state_dict(state)
    x = torch.randn(5, 2, 3)
    torch.testing.assert_close(model(x)[0], plain(x)[0])


def test_convert_leaves_proj_size_on_autograd_with_a_reason():
    from lightning_bppsa.nn import ConversionRecord

    report: list[ConversionRecord] = []
    lstm = nn.LSTM(3, 4, proj_size=2)
    assert convert(lstm, report=report) is lstm
    assert not report[0].scanned and "proj_size" in report[0].reason


def test_convert_leaves_a_parametrized_layer_on_autograd_with_a_reason():
    from lightning_bppsa.nn import ConversionRecord

    report: list[ConversionRecord] = []
    model = nn.Sequential(nn.GRU(3, 4))
    torch.nn.utils.parametrizations.orthogonal(model[0], "weight_hh_l0")
    layer = model[0]
    assert convert(model, report=report)[0] is layer
    (record,) = [r for r in report if r.path == "0"]
    assert not record.scanned and "parametrize" in record.reason and "lightning_bppsa.nn.GRU" in record.reason


def test_unsupported_inputs_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="proj_size"):
        bnn.LSTM(3, 4, proj_size=2)
    with pytest.raises(ValueError, match="algorithm"):
        bnn.RNN(3, 4, algorithm="fast")


def test_packed_sequences_and_complex_inputs_run_torchs_own_code_with_the_reason():
    """A converted model never fails where the torch model runs (issue #19 item 9)."""
    ours = bnn.GRU(3, 4).double()
    ref = _torch_twin("GRU", ours).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 3])
    with pytest.warns(UserWarning, match="PackedSequence runs torch's own forward") as seen:
        out, h_n = ours(packed)
        ours(packed)
    assert len(seen) == 1
    ref_out, ref_h = ref(packed)
    torch.testing.assert_close(out.data, ref_out.data, rtol=0, atol=0)
    torch.testing.assert_close(h_n, ref_h, rtol=0, atol=0)
    assert ours.last_stats["path"] == "autograd" and "PackedSequence" in ours.last_stats["plan"]
    h_n.sum().backward()
    ref_h.sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    rnn = bnn.RNN(3, 4).to(torch.complex128)
    z = torch.randn(5, 2, 3, dtype=torch.complex128)
    out, _ = rnn(z)
    assert rnn.last_stats["path"] == "autograd" and "complex" in rnn.last_stats["plan"]
    torch.testing.assert_close(out, _torch_twin("RNN", rnn).to(torch.complex128)(z)[0], rtol=0, atol=0)


def _torch_twin(cell, ours):
    ref = getattr(nn, cell)(ours.input_size, ours.hidden_size, num_layers=ours.num_layers,
                            batch_first=ours.batch_first, bidirectional=ours.bidirectional)  # fmt: skip
    ref.load_state_dict(ours.state_dict())
    return ref


def _state(cell, shape, dtype=torch.float32):
    h = torch.zeros(shape, dtype=dtype)
    return (h, h) if cell == "LSTM" else h


# everyday mistakes: (input shape, input dtype, hx shape or None)
MISTAKES = {
    "input size": ((5, 2, 4), torch.float32, None),
    "input dtype": ((5, 2, 3), torch.float64, None),
    "hx batch size": ((5, 2, 3), torch.float32, (1, 3, 4)),
    "hx dims": ((5, 2, 3), torch.float32, (3, 4)),
    "input dims": ((5, 2, 3, 1), torch.float32, None),
    "unbatched hx dims": ((5, 3), torch.float32, (1, 1, 4)),
}


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_everyday_mistakes_raise_torchs_own_error(cell, mistake):
    shape, dtype, hx_shape = MISTAKES[mistake]
    ours = PAIRS[cell][0](3, 4, algorithm="chunked")
    ref = _torch_twin(cell, ours)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    hx = None if hx_shape is None else _state(cell, hx_shape)
    with pytest.raises(Exception) as expected:
        ref(x, hx)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        ours(x, hx)


@pytest.fixture
def injected_cost_model(monkeypatch):
    """``cost_model.recurrent_seconds`` (what "auto" asks on CPU) replaced: it predicts
    ``predictions[(batch, n, hidden)]`` = ``(scan, autograd)`` seconds and records each question, so that what
    "auto" is expected to do follows from the model it asks, not from measured constants that move whenever
    the model is re-fitted (tests/conftest.py forgets the layers' decisions around every test)."""
    from lightning_bppsa import cost_model

    predictions, asked = {}, []

    def recurrent_seconds(cost, *, n, hidden, batch, width, device, native, fused=False):
        asked.append((batch, n, hidden, device))
        return predictions[(batch, n, hidden)]

    monkeypatch.setattr(cost_model, "recurrent_seconds", recurrent_seconds)
    return predictions, asked


@pytest.mark.parametrize("answer", ["scan", "autograd"])
@pytest.mark.parametrize(("cell", "batch", "length"), [("RNN", 1, 2), ("LSTM", 16, 100)])
def test_auto_takes_the_cost_models_path_and_records_it(injected_cost_model, answer, cell, batch, length):
    predictions, asked = injected_cost_model
    fast, slow = 1e-3, 1e-2  # ten times apart: the model is sure, nothing is measured
    predictions[(batch, length, 20)] = (fast, slow) if answer == "scan" else (slow, fast)
    layer = getattr(bnn, cell)(3, 20, batch_first=True)
    for _ in range(2):
        layer(torch.randn(batch, length, 3, requires_grad=True))[0].sum().backward()
        assert layer.last_stats["path"] == answer and layer.last_stats["algorithm"] == "auto"
    assert asked == [(batch, length, 20, "cpu")]  # asked once for the shape
    if answer == "autograd":
        assert "cost model" in layer.last_stats["plan"], layer.last_stats
    with torch.no_grad():
        layer(torch.randn(2, 10, 3))
    assert layer.last_stats["path"] == "forward kernel"  # inference: the forward kernel, nothing to scan
    assert len(asked) == 1  # and the cost model is not asked


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_inference_runs_the_forward_kernel_and_equals_torch(cell, batch_first):
    torch.manual_seed(0)
    ours = getattr(bnn, cell)(3, 5, num_layers=2, bidirectional=True, batch_first=batch_first, dropout=0.5,
                              dtype=torch.float64).eval()  # fmt: skip
    ref = _torch_twin(cell, ours).double().eval()
    ref.load_state_dict(ours.state_dict())  # again, in float64
    ref.dropout = ours.dropout
    x = torch.randn((4, 7, 3) if batch_first else (7, 4, 3), dtype=torch.float64)
    hx = _state(cell, (4, 4, 5), torch.float64)
    hx = tuple(torch.randn_like(h) for h in hx) if cell == "LSTM" else torch.randn_like(hx)
    for args in ((x,), (x, hx), (x[0] if batch_first else x[:, 0],)):  # default state, given state, unbatched
        with torch.no_grad():
            got, want = ours(*args), ref(*args)
        assert ours.last_stats["path"] == "forward kernel", ours.last_stats
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.inference_mode():  # Lightning validates under it: no version counters there
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-10, atol=1e-12)
    ours.train()  # dropout between layers under no_grad: torch's mask from the same seed
    with torch.no_grad():
        torch.manual_seed(1)
        got = ours(x)
        torch.manual_seed(1)
        want = ref.train()(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_inference_without_the_kernels_runs_torchs_forward(monkeypatch):
    from lightning_bppsa.kernels import recurrent as native

    monkeypatch.setattr(native, "available", lambda: False)
    rnn = bnn.GRU(3, 5)
    with torch.no_grad():
        out = rnn(torch.randn(6, 2, 3))[0]
    assert rnn.last_stats["path"] == "autograd" and "no gradient needed" in rnn.last_stats["plan"]
    assert out.shape == (6, 2, 5)


def test_batch_and_length_may_change_between_calls():
    rnn = bnn.GRU(2, 3, batch_first=True, algorithm="chunked", dtype=torch.float64)
    for batch, length in [(4, 10), (1, 3), (7, 20)]:
        x = torch.randn(batch, length, 2, dtype=torch.float64, requires_grad=True)
        rnn(x)[0].sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
def test_bf16_autocast_gradients_match_autograd_under_the_same_autocast(cell):
    # the fused forward runs in bfloat16 under autocast; the scan backward runs in the parameters' float32
    from lightning_bppsa.testing import relative_error

    torch.manual_seed(0)
    ours = getattr(bnn, cell)(3, 8, batch_first=True, algorithm="chunked")
    ref = getattr(nn, cell)(3, 8, batch_first=True)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 40, 3)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out, _ = ref(x)
    except RuntimeError:
        # some CPUs (no AVX-512 BF16) make oneDNN refuse torch's own bf16 LSTM under autocast; ours runs
        # the layer in bfloat16 as autocast asks: compare with torch's module cast to bfloat16 by hand
        ref_bf16 = getattr(nn, cell)(3, 8, batch_first=True).to(torch.bfloat16)
        ref_bf16.load_state_dict(ours.state_dict())
        ref_out, _ = ref_bf16(x.to(torch.bfloat16))
        ref_out.float().pow(2).sum().backward()
        for q, q16 in zip(ref.parameters(), ref_bf16.parameters(), strict=True):
            q.grad = q16.grad.float()
    else:
        ref_out.float().pow(2).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = ours(x)
    out.float().pow(2).sum().backward()
    assert ours.last_stats["path"] == "scan"
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert p.grad.dtype == torch.float32, name
        assert relative_error(p.grad, q.grad) < 5e-2, name


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_empty_batch_gives_torchs_empty_outputs_and_gradients(cell, batch_first):
    ours = PAIRS[cell][0](3, 4, num_layers=2, batch_first=batch_first)  # "auto", as users build it
    ref = _torch_twin(cell, ours)
    shape = (0, 5, 3) if batch_first else (5, 0, 3)
    results = []
    for module in (ours, ref):
        x = torch.randn(shape, requires_grad=True)
        output, h_n = module(x)
        states = h_n if cell == "LSTM" else (h_n,)
        (output.sum() + sum(s.sum() for s in states)).backward()
        results.append([output.shape, *(s.shape for s in states), x.grad.shape])
        results[-1] += [p.grad for p in module.parameters()]
    for a, b in zip(*results, strict=True):
        assert a == b if isinstance(a, torch.Size) else torch.equal(a, b)


@pytest.mark.parametrize("cell", list(PAIRS))
def test_meta_device_forward_and_backward_like_torch(cell):
    ours = PAIRS[cell][0](3, 4, algorithm="chunked", device="meta")
    x = torch.randn(5, 2, 3, device="meta", requires_grad=True)
    output, _ = ours(x)
    output.sum().backward()  # no values to scan: torch's forward and backward, which work on meta
    assert output.shape == (5, 2, 4) and x.grad.shape == x.shape and ours.last_stats["path"] == "autograd"


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize("batch_first", [True, False])
def test_bidirectional_dropout_matches_torch_with_the_same_seed(cell, batch_first):
    kw = dict(num_layers=3, dropout=0.4, bidirectional=True, batch_first=batch_first, dtype=torch.float64)
    ours = PAIRS[cell][0](3, 4, algorithm="chunked", **kw)
    ref = PAIRS[cell][1](3, 4, **kw)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    found = []
    for module in (ours, ref):
        torch.manual_seed(7)
        output, _ = module(x)
        found.append([output, *torch.autograd.grad((output**2).sum(), [x, *module.parameters()])])
    assert ours.last_stats["path"] == "scan"
    for a, b in zip(*found, strict=True):
        assert_derived_close(a, b, floor=1e-12)


def _gradient_penalty_grads(module, x):
    """Gradients of a gradient penalty ``‖∇_θ l‖² + ‖∇_x l‖²`` (double backward)."""
    params = list(module.parameters())
    output, _ = module(x)
    first = torch.autograd.grad((output**2).sum() + output.sum(), [x, *params], create_graph=True)
    penalty = sum((g**2).sum() for g in first)
    return torch.autograd.grad(penalty, [x, *params])


@pytest.mark.parametrize("cell", list(PAIRS))
def test_gradient_penalty_equals_torchs(cell):
    ours = PAIRS[cell][0](3, 4, num_layers=2, algorithm="chunked", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, num_layers=2, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    actual = _gradient_penalty_grads(ours, x)
    assert ours.last_stats["path"] == "scan"
    for i, (a, b) in enumerate(zip(actual, _gradient_penalty_grads(ref, x), strict=True)):
        assert a is not None, f"gradient #{i} is None"
        assert_derived_close(a, b, floor=1e-9, name=f"{cell} penalty grad #{i}")


@pytest.mark.parametrize("cell", list(PAIRS))
def test_torch_func_grad_of_functional_call_equals_torchs(cell):
    ours = PAIRS[cell][0](3, 4, algorithm="chunked", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(5, 2, 3, dtype=torch.float64)

    def grads(module):
        params = {k: v.detach() for k, v in module.named_parameters()}
        loss = lambda p: (torch.func.functional_call(module, p, (x,))[0] ** 2).sum()  # noqa: E731
        return torch.func.grad(loss)(params)

    actual, expected = grads(ours), grads(ref)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert_derived_close(actual[name], expected[name], floor=1e-9, name=name)


class _Scaled(nn.Module):
    """A parametrization: the weight used is half the one stored."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 0.5 * weight


@pytest.mark.parametrize("cell", list(PAIRS))
def test_parametrized_weights_get_torchs_gradients(cell):
    """``torch.nn.utils.parametrize`` (an orthogonal ``W_hh``, a common RNN recipe, and a custom one) replaces
    weights by properties computed at each access: the layer scans with them, every step, and the stored
    parameters get torch's gradients (it raised a KeyError where it memoised its plan)."""
    ours = PAIRS[cell][0](3, 4, num_layers=2, algorithm="linear", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, num_layers=2, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    for module in (ours, ref):
        torch.nn.utils.parametrizations.orthogonal(module, "weight_hh_l0")
        torch.nn.utils.parametrize.register_parametrization(module, "weight_ih_l1", _Scaled())
    ref.load_state_dict(ours.state_dict())
    for _ in range(2):  # the second call: where a plan memoised on the first would answer
        x = torch.randn(5, 2, 3, dtype=torch.float64)
        for module in (ours, ref):
            module.zero_grad()
            (module(x)[0] ** 2).sum().backward()
        assert ours.last_stats["path"] == "scan"
        for (name, actual), expected in zip(ours.named_parameters(), ref.parameters(), strict=True):
            assert_derived_close(actual.grad, expected.grad, name=name)


class _Model(nn.Module):
    """A user's model around a recurrent layer (torch 2.13 scripts torch's own RNN modules only as
    submodules: a scripted top-level ``nn.RNN`` has no ``forward``, only its overloads)."""

    def __init__(self, recurrent: nn.Module) -> None:
        super().__init__()
        self.recurrent = recurrent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recurrent(x)[0]


@pytest.mark.parametrize("cell", list(PAIRS))
def test_jit_script_runs_torchs_forward_on_the_same_parameters(cell):
    ours = PAIRS[cell][0](3, 4, num_layers=2, algorithm="chunked", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, num_layers=2, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    params = list(ours.parameters())
    scripted = torch.jit.script(_Model(ours))
    assert [id(p) for p in scripted.parameters()] == [id(p) for p in params]
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    actual = torch.autograd.grad((scripted(x) ** 2).sum(), [x, *params])
    expected = torch.autograd.grad((ref(x)[0] ** 2).sum(), [x, *ref.parameters()])
    for a, b in zip(actual, expected, strict=True):
        assert_derived_close(a, b, floor=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("cell", list(PAIRS))
def test_compile_fullgraph_runs_the_scan_and_equals_torch(cell, monkeypatch):
    import torch._dynamo

    from lightning_bppsa.cells import RecurrentCell

    def autograd_fallback(*args, **kwargs):
        raise AssertionError("the compiled backward must be the scan, not the autograd fallback")

    monkeypatch.setattr(RecurrentCell, "autograd_gradients", autograd_fallback)
    torch._dynamo.reset()
    ours = PAIRS[cell][0](3, 4, algorithm="chunked", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")  # dynamo + AOTAutograd, no C++ build
    # dynamo refuses every nn.RNN subclass without allow_rnn; with it, each layer is two opaque ops
    with torch._dynamo.config.patch(allow_rnn=True):
        actual = torch.autograd.grad((compiled(x)[0] ** 2).sum(), [x, *ours.parameters()])
    expected = torch.autograd.grad((ref(x)[0] ** 2).sum(), [x, *ref.parameters()])
    assert ours.last_stats["path"] == "scan" and ours.last_stats["scan_seconds"] == 0  # no clock in a graph
    for a, b in zip(actual, expected, strict=True):
        assert_derived_close(a, b, floor=1e-9)


@pytest.mark.parametrize("cell", list(PAIRS))
def test_compile_without_allow_rnn_runs_the_layers_eagerly_and_equals_torch(cell):
    """Issue #20: dynamo refuses an nn.RNN subclass unless allow_rnn (a graph break); the module then runs
    as in eager mode, the scan included, with dynamo's frame hook off inside it: no compiled graph holds
    the layers' ops (its runtime wrappers cost more than the one op each way), gradients equal torch's."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ours = PAIRS[cell][0](3, 4, num_layers=2, bidirectional=True, algorithm="linear", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, num_layers=2, bidirectional=True, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(lambda inputs: (ours(inputs)[0] ** 2).sum(), backend=recording)
    actual = torch.autograd.grad(compiled(x), [x, *ours.parameters()])
    expected = torch.autograd.grad((ref(x)[0] ** 2).sum(), [x, *ref.parameters()])
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes]
    assert not any("autograd_function_apply" in op or "bppsa" in op for op in ops), ops
    assert ours.last_stats["path"] == "scan" and ours.last_stats["scan_seconds"] > 0  # ran eagerly: timed
    for a, b in zip(actual, expected, strict=True):
        assert_derived_close(a, b, floor=1e-9)


@pytest.mark.slow
def test_compiled_module_takes_a_new_batch_size_without_planning_in_the_trace():
    """Issue #19 item 4: a smaller last batch under torch.compile(fullgraph=True) (dynamic shapes)."""
    import torch._dynamo

    torch._dynamo.reset()
    ours = bnn.RNN(3, 5, batch_first=True, algorithm="linear").double()
    ref = _torch_twin("RNN", ours).double()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(allow_rnn=True):
        for batch in (4, 3, 2):
            x = torch.randn(batch, 7, 3, dtype=torch.float64)
            actual = torch.autograd.grad(compiled(x)[0].pow(2).sum(), list(ours.parameters()))
            expected = torch.autograd.grad(ref(x)[0].pow(2).sum(), list(ref.parameters()))
            for a, b in zip(actual, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["linear", "chunked"])
def test_relu_rnn_matches_torch_where_nans_reach_the_forward_or_the_gradient(algorithm):
    """Issue #19 item 5: torch's ReLU backward passes the gradient through a NaN output and gives 0 where
    the output is <= 0 even for a NaN upstream gradient."""
    torch.manual_seed(3)
    ours = bnn.RNN(2, 4, nonlinearity="relu", batch_first=True, algorithm=algorithm).double()
    ref = nn.RNN(2, 4, nonlinearity="relu", batch_first=True).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 2, dtype=torch.float64)
    x[0, 3, 0] = float("nan")
    grad = torch.randn(2, 6, 4, dtype=torch.float64)
    grad[1, 2, 1] = float("nan")
    results = []
    for module in (ours, ref):
        leaf = x.clone().requires_grad_()
        out, _ = module(leaf)
        out.backward(grad)
        results.append([out, leaf.grad, *(p.grad for p in module.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch ops dispatched while active (issue #20: a backward with few ops)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cell", ["RNN", "GRU", "LSTM"])
def test_one_layer_backward_is_one_op_whatever_the_length(cell):
    """The whole backward of a layer is the op ``bppsa::recurrent_backward`` plus autograd's bookkeeping
    (a constant few ops), never ops per time step; torch's own autograd dispatches several per step."""
    counts = {}
    for steps in (10, 200):
        ours = getattr(bnn, cell)(3, 8, batch_first=True, algorithm="linear")
        loss = ours(torch.randn(4, steps, 3))[0][:, -1].pow(2).sum()
        with _OpCounter() as counter:
            loss.backward()
        counts[steps] = counter.ops
    assert counts[10] == counts[200]
    assert counts[200].count("bppsa.recurrent_backward") == 1 and len(counts[200]) <= 15, counts[200]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cell", ["RNN", "GRU"])
def test_output_modified_in_place_still_backpropagates_like_torch(cell, batch_first):
    # torch's RNN / GRU let the caller modify the output in place before backward; the scan's saved
    # states must not be that tensor
    ours = PAIRS[cell][0](3, 4, batch_first=batch_first, algorithm="linear", dtype=torch.float64)
    ref = PAIRS[cell][1](3, 4, batch_first=batch_first, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    grads = []
    for module in (ours, ref):
        out, _ = module(x)
        out.mul_(2.0)
        (out**2).sum().backward()
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("modify", [False, True])
def test_backward_recomputes_the_states_only_after_an_in_place_change(modify):
    # eagerly the layer returns its saved states themselves (no copy); an in-place change moves their
    # version, and only then does the backward run the forward op again
    ours = bnn.RNN(3, 4, batch_first=True, algorithm="linear", dtype=torch.float64)
    out, _ = ours(torch.randn(2, 6, 3, dtype=torch.float64))
    if modify:
        out.add_(1.0)
    with _OpCounter() as counter:
        out.pow(2).sum().backward()
    assert counter.ops.count("bppsa.recurrent_forward") == int(modify), counter.ops


@pytest.mark.parametrize("modify", [False, True])
def test_a_second_backward_with_retain_graph_matches_torch(modify):
    """A retained graph keeps the layer's states for the next backward, as autograd keeps saved tensors: no
    forward runs again, unless the output was modified in place between the backwards (then the states are
    recomputed; the same values here, so the gradients are still torch's). Without ``retain_graph`` a further
    backward raises as torch's does."""
    ours = bnn.GRU(3, 4, batch_first=True, algorithm="linear", dtype=torch.float64)
    ref = nn.GRU(3, 4, batch_first=True, dtype=torch.float64)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    for module in (ours, ref):
        out = module(x)[0]
        loss = 2 * out.sum() + out[:, -1].sum()  # nothing downstream saves out
        loss.backward(retain_graph=True)
        if modify and module is ours:
            with torch.no_grad():
                out.add_(0.0)  # the same values, a new version
        with _OpCounter() as counter:
            loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        if module is ours:
            assert counter.ops.count("bppsa.recurrent_forward") == int(modify), counter.ops
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


class _TensorSubclass(torch.Tensor):
    """A tensor subclass: through ``__torch_function__`` / ``__torch_dispatch__`` a subclass may handle the op."""


def test_layers_bypass_the_dispatcher_only_when_nothing_intercepts_it():
    """Eagerly the layer calls its ops' Python implementations directly (the dispatcher costs ~16 µs a call
    to reach them); anything that could intercept the op gets the dispatched op."""
    from lightning_bppsa.nn._scan_layer import _dispatched

    plain = [torch.randn(2, 3), None, torch.nn.Parameter(torch.randn(3))]
    assert not _dispatched(plain)
    with _OpCounter():
        assert _dispatched(plain)
    with torch.overrides.TorchFunctionMode():
        assert _dispatched(plain)
    with torch.profiler.profile():
        assert _dispatched(plain)
    assert _dispatched([*plain, torch.randn(2).as_subclass(_TensorSubclass)])


def test_the_profiler_and_dispatch_modes_still_see_the_layer_ops():
    ours = bnn.GRU(3, 4, batch_first=True, algorithm="linear")
    with _OpCounter() as counter:
        ours(torch.randn(2, 5, 3))[0].sum().backward()
    assert counter.ops.count("bppsa.recurrent_forward") == 1
    assert counter.ops.count("bppsa.recurrent_backward") == 1
    with torch.profiler.profile() as prof:
        ours(torch.randn(2, 5, 3))[0].sum().backward()
    names = {event.key for event in prof.key_averages()}
    assert {"bppsa::recurrent_forward", "bppsa::recurrent_backward"} <= names


def test_eager_forward_runs_without_the_dynamo_disable_wrapper(monkeypatch):
    """No compiled caller: nothing to switch off, so the eager call skips ``torch.compiler.disable``'s
    wrapper (whose frame-callback switching costs a few µs a call)."""
    import lightning_bppsa.nn.recurrent as recurrent

    def refuse():
        raise AssertionError("the disable wrapper ran in eager mode")

    monkeypatch.setattr(recurrent, "_without_dynamo", refuse)
    ours = bnn.RNN(2, 3, batch_first=True)
    out, h_n = ours(torch.randn(2, 4, 2))
    assert out.shape == (2, 4, 3) and torch.equal(h_n[0], out[:, -1])


def test_a_memoised_decision_answers_only_a_call_like_the_one_that_made_it(monkeypatch):
    """A training loop's calls (same shape, dtype, device, gradients needed, parameters, initial state's sizes)
    reuse the first call's decision without asking again (issue 28: torch's layer pays ~1 µs, not ~10); any
    change that could change the decision asks again, and each answer is the one a fresh module gives."""
    torch.manual_seed(0)
    ours = bnn.RNN(2, 3, batch_first=True, algorithm="linear")
    asked = []
    real_path = type(ours)._path
    monkeypatch.setattr(type(ours), "_path", lambda self, *a: asked.append(1) or real_path(self, *a))
    x = torch.randn(2, 4, 2)

    def path_of(*args, **kwargs) -> tuple[str, int]:
        before = len(asked)
        ours(*args, **kwargs)
        return ours.last_stats["path"], len(asked) - before

    def memoised() -> None:  # x's decision memoised again before each change
        path_of(x)
        assert path_of(x) == ("scan", 0)

    checked = []
    real_check = type(ours).check_forward_args
    monkeypatch.setattr(type(ours), "check_forward_args", lambda self, *a: checked.append(1) or real_check(self, *a))
    assert path_of(x) == ("scan", 1) and len(checked) == 1
    assert path_of(x) == ("scan", 0) and path_of(x.clone()) == ("scan", 0)  # same key: not asked again
    assert len(checked) == 1  # nor torch's checks (passed by the call that made the memo)
    ours.last_stats["path"] = "changed by the caller"  # the memo keeps its own copy
    assert path_of(x) == ("scan", 0)
    memoised()
    assert path_of(torch.randn(2, 5, 2)) == ("scan", 1)  # another length
    memoised()
    ours.double()
    with pytest.raises(ValueError, match="torch.float64"):  # torch's check of the dtypes, not skipped
        ours(x)
    assert path_of(x.double()) == ("scan", 1)  # another dtype
    ours.float()
    memoised()
    with torch.no_grad():
        assert path_of(x)[1] == 1 and ours.last_stats["path"] != "scan"
    memoised()
    ours.algorithm = "chunked"
    assert path_of(x) == ("scan", 1) and ours.last_stats["decision"] == "algorithm='chunked' as asked"
    memoised()
    swapped = {name: p.detach().clone().requires_grad_() for name, p in ours.named_parameters()}
    before = len(asked)
    torch.func.functional_call(ours, swapped, (x,))
    assert len(asked) == before + 1  # other parameters: asked again
    memoised()
    for p in ours.parameters():
        p.requires_grad_(False)
    assert path_of(x)[1] == 1 and ours.last_stats["path"] != "scan"  # nothing needs a gradient
    assert path_of(x) == ("forward kernel", 0)  # an inference decision is memoised too
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's state is in the key: torch's forward there
        assert path_of(x) == ("autograd", 1) and path_of(x) == ("autograd", 0)
    for p in ours.parameters():
        p.requires_grad_(True)
    h0 = torch.zeros(1, 2, 3)
    assert path_of(x, h0)[1] == 1 and path_of(x, h0 + 1) == ("scan", 0)  # an initial state: its shapes in the key
    for _ in range(2):  # a call torch's checks refuse leaves no memo: the same call raises their error again
        with pytest.raises(RuntimeError, match="Expected hidden size"):
            ours(x, torch.zeros(1, 3, 3))  # another state size: torch's checks run
    assert path_of(x, h0.requires_grad_())[1] == 1  # a state needing a gradient
    memoised()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="input.size\\(-1\\) must be equal to input_size"):
            ours(torch.randn(2, 4, 3))  # another shape: torch's checks run
    ours.weight_hh_l0 = nn.Parameter(torch.randn(3, 3))  # another parameter: the layer runs on it
    reference = nn.RNN(2, 3, batch_first=True)
    reference.load_state_dict(ours.state_dict())
    assert path_of(x)[1] == 1 and torch.allclose(ours(x)[0], reference(x)[0], atol=1e-6)
