"""Outside re-run (#19): fuzz the converted RNN/GRU/LSTM against torch, torch's own module_db samples, and
bad inputs to the modules and to ``backprop_scan``. Written by someone who did not write the library."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import lightning_bppsa
from lightning_bppsa import layer_plan
from lightning_bppsa.nn import convert

TORCH_TYPES = {"RNN": nn.RNN, "GRU": nn.GRU, "LSTM": nn.LSTM}
ALGORITHMS = ["linear", "blelloch", "chunked", "auto"]


def _pair(kind: str, algorithm: str, seed: int, **kwargs):
    """A float64 torch module and its converted copy with equal weights (distinct Parameter objects)."""
    torch.manual_seed(seed)
    ref = TORCH_TYPES[kind](**kwargs).double()
    ours = convert(copy.deepcopy(ref))
    assert type(ours).__module__.startswith("lightning_bppsa"), type(ours)
    ours.algorithm = algorithm
    return ref, ours


def _run(module, x, hx, weights, every_step, seed):
    """Forward with a fixed dropout seed, a weighted loss on every step or the last, then the gradients."""
    leaves = [x] + ([] if hx is None else list(hx) if isinstance(hx, tuple) else [hx])
    for t in leaves:
        t.grad = None
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out, h_n = module(x, hx)
    time_dim = 1 if module.batch_first else 0
    states = h_n if isinstance(h_n, tuple) else (h_n,)
    if every_step:
        loss = (out * weights).sum()
    else:
        loss = (out.select(time_dim, -1) * weights.select(time_dim, -1)).sum()
    loss = loss + sum((s.sin()).sum() for s in states) * 0.5
    loss.backward()
    grads = [t.grad for t in leaves] + [p.grad for p in module.parameters()]
    return [out, *states], grads


@st.composite
def _cases(draw):
    kind = draw(st.sampled_from(sorted(TORCH_TYPES)))
    layers = draw(st.integers(1, 3))
    return dict(
        kind=kind,
        algorithm=draw(st.sampled_from(ALGORITHMS)),
        input_size=draw(st.integers(1, 40)),
        hidden_size=draw(st.integers(1, 40)),
        num_layers=layers,
        bidirectional=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        bias=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.3])) if layers > 1 else 0.0,
        train=draw(st.booleans()),
        batch=draw(st.integers(1, 5)),
        steps=draw(st.integers(1, 60)),
        with_h0=draw(st.booleans()),
        every_step=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _check_case(case: dict) -> None:
    kw = {k: case[k] for k in ("input_size", "hidden_size", "num_layers", "bidirectional", "batch_first", "bias",
                               "dropout")}
    ref, ours = _pair(case["kind"], case["algorithm"], case["seed"], **kw)
    ref.train(case["train"])
    ours.train(case["train"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    b, t, dirs = case["batch"], case["steps"], 2 if case["bidirectional"] else 1
    shape = (b, t, case["input_size"]) if case["batch_first"] else (t, b, case["input_size"])
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    hx = None
    if case["with_h0"]:
        h0 = torch.randn(case["num_layers"] * dirs, b, case["hidden_size"], generator=g, dtype=torch.float64)
        hx = (h0, torch.randn(h0.shape, generator=g, dtype=torch.float64)) if case["kind"] == "LSTM" else h0
    out_shape = shape[:2] + (dirs * case["hidden_size"],)
    weights = torch.randn(out_shape, generator=g, dtype=torch.float64)

    def leaf(v):
        return v.clone().requires_grad_()

    def leaves():
        if hx is None:
            return leaf(x), None
        return leaf(x), tuple(leaf(s) for s in hx) if isinstance(hx, tuple) else leaf(hx)

    ref_vals, ref_grads = _run(ref, *leaves(), weights, case["every_step"], case["seed"])
    our_vals, our_grads = _run(ours, *leaves(), weights, case["every_step"], case["seed"])
    if ours.last_stats["path"] == "autograd":
        # only "auto" may run torch's own forward, and only on the cost model's word; that run compared
        # torch with torch, so the scan is compared too, with an explicit algorithm
        assert case["algorithm"] == "auto" and "cost model" in ours.last_stats["plan"], ours.last_stats
        _assert_same(our_vals, our_grads, ref_vals, ref_grads)
        ours.algorithm = ALGORITHMS[case["seed"] % 3]
        our_vals, our_grads = _run(ours, *leaves(), weights, case["every_step"], case["seed"])
    assert ours.last_stats["path"] == "scan", ours.last_stats
    _assert_same(our_vals, our_grads, ref_vals, ref_grads)


def _assert_same(our_vals: list, our_grads: list, ref_vals: list, ref_grads: list) -> None:
    """Outputs, final states and gradients equal torch's to 1e-10 (float64)."""
    for name, a, r in zip(["output", "h_n", "c_n"][: len(ref_vals)], our_vals, ref_vals, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    for i, (a, r) in enumerate(zip(our_grads, ref_grads, strict=True)):
        assert (a is None) == (r is None), f"grad {i}: one is None"
        if r is not None:
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, i=i: f"grad {i}: {m}")


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_fuzz_converted_recurrent_equals_torch_float64(case):
    _check_case(case)


@pytest.mark.parametrize("kind", sorted(TORCH_TYPES))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_corner_sizes_equal_torch(kind, algorithm):
    """B=1, T=1, sizes 1, two layers, bidirectional, dropout in train mode: the smallest everything."""
    _check_case(dict(kind=kind, algorithm=algorithm, input_size=1, hidden_size=1, num_layers=2,
                     bidirectional=True, batch_first=False, bias=True, dropout=0.5, train=True, batch=1,
                     steps=1, with_h0=True, every_step=False, seed=3))


# ---------------------------------------------------------------- torch's own module_db samples

def _module_db_entries():
    # torch's internal test helpers import expecttest, which is not in the [dev] extra
    pytest.importorskip("expecttest", reason="torch's module_db needs expecttest (pip install expecttest)")
    from torch.testing._internal.common_modules import module_db

    # importing torch's test helpers calls torch.backends.disable_global_flags(): every later test in this
    # process that sets a cudnn flag (Lightning's deterministic=True) would raise. Undo that side effect.
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return [info for info in module_db if info.module_cls in TORCH_TYPES.values()]


def _flatten(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flatten(v)]
    return []


def _call(module, args, kwargs):
    """Outputs and gradients of every floating leaf, or the error type the call raised."""
    try:
        out = module(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001  (the error type is the result being compared)
        return type(exc), None
    outs = [o for o in _flatten(out) if o.is_floating_point()]
    leaves = [t for t in _flatten((args, kwargs)) if t.requires_grad] + list(module.parameters())
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else ()
    return outs, grads


@pytest.mark.slow
def test_torch_module_db_samples():
    entries = _module_db_entries()
    assert {info.module_cls for info in entries} == set(TORCH_TYPES.values())
    checked = unconverted = 0
    for info in entries:
        for training in (False, True):
            inputs = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                             training=training)
            for mi in inputs:
                ctor, fwd = mi.constructor_input, mi.forward_input
                if fwd is None:
                    continue
                torch.manual_seed(0)
                ref = info.module_cls(*ctor.args, **ctor.kwargs).to(torch.float64).train(training)
                ours = convert(copy.deepcopy(ref)).train(training)
                if type(ours) is info.module_cls:  # documented: LSTM proj_size > 0 stays torch's
                    assert ctor.kwargs.get("proj_size", 0) > 0, f"{ctor.kwargs} not converted"
                    unconverted += 1
                    continue
                args_r, kw_r = copy.deepcopy((fwd.args, fwd.kwargs))
                args_o, kw_o = copy.deepcopy((fwd.args, fwd.kwargs))
                torch.manual_seed(1)
                ref_res = _call(ref, args_r, kw_r)
                torch.manual_seed(1)
                our_res = _call(ours, args_o, kw_o)
                label = f"{info.module_cls.__name__} {ctor.kwargs} {mi.desc}"
                if isinstance(ref_res[0], type):
                    assert our_res[0] is ref_res[0], f"{label}: error {our_res[0]} != torch's {ref_res[0]}"
                else:
                    assert not isinstance(our_res[0], type), f"{label}: raised {our_res[0]}"
                    ours_all, ref_all = our_res[0] + list(our_res[1]), ref_res[0] + list(ref_res[1])
                    for a, r in zip(ours_all, ref_all, strict=True):
                        assert (a is None) == (r is None), label
                        if r is not None:
                            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, lab=label: f"{lab}: {m}")
                checked += 1
    print(f"module_db: {checked} samples compared, {unconverted} left unconverted (proj_size)")
    assert checked >= 10 and unconverted <= checked, (checked, unconverted)


# ---------------------------------------------------------------- bad inputs


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return None, ""


BAD_MODULE_INPUTS = {
    "3d input wrong feature size": lambda kind: (torch.randn(4, 2, 3), None),
    "4d input": lambda kind: (torch.randn(4, 2, 5, 1), None),
    "1d input": lambda kind: (torch.randn(5), None),
    "float32 input, float64 weights": lambda kind: (torch.randn(4, 2, 5, dtype=torch.float32), None),
    "int input": lambda kind: (torch.ones(4, 2, 5, dtype=torch.long), None),
    "h0 wrong batch": lambda kind: (torch.randn(4, 2, 5), _h(kind, 2, 3, 6)),
    "h0 wrong hidden": lambda kind: (torch.randn(4, 2, 5), _h(kind, 2, 2, 7)),
    "h0 wrong layers": lambda kind: (torch.randn(4, 2, 5), _h(kind, 1, 2, 6)),
    "h0 2d with batched input": lambda kind: (torch.randn(4, 2, 5), _h(kind, None, 2, 6)),
    "h0 tuple for non-LSTM / tensor for LSTM": lambda kind: (
        torch.randn(4, 2, 5), torch.zeros(2, 2, 6) if kind == "LSTM" else (torch.zeros(2, 2, 6),) * 2),
    "h0 float32": lambda kind: (torch.randn(4, 2, 5), _h(kind, 2, 2, 6, torch.float32)),
}


def _h(kind, layers, batch, hidden, dtype=torch.float64):
    shape = (batch, hidden) if layers is None else (layers, batch, hidden)
    h = torch.zeros(shape, dtype=dtype)
    return (h, h.clone()) if kind == "LSTM" else h


@pytest.mark.parametrize("case", sorted(BAD_MODULE_INPUTS))
@pytest.mark.parametrize("kind", sorted(TORCH_TYPES))
def test_bad_module_inputs_raise_torchs_error(kind, case):
    ref, ours = _pair(kind, "linear", 0, input_size=5, hidden_size=6, num_layers=2)
    x, hx = BAD_MODULE_INPUTS[case](kind)
    x = x.double() if x.dtype == torch.float32 and "float32" not in case else x
    if x.is_floating_point():
        x.requires_grad_()
    ref_err = _error_of(lambda: ref(x, hx))
    our_err = _error_of(lambda: ours(x, hx))
    assert ref_err[0] is not None, f"torch accepted {case}"
    assert our_err[0] is ref_err[0], f"{case}: ours {our_err} vs torch {ref_err}"


def _good_scan():
    return torch.randn(2, 4, 3, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)


BAD_SCAN = {
    "jacobians 3d": (lambda j, g: (j[0], g), "jacobians_t"),
    "jacobians not square": (lambda j, g: (j[..., :2], g), "jacobians_t"),
    "grad wrong width": (lambda j, g: (j, g[:, :2]), "grad"),
    "grad wrong batch": (lambda j, g: (j, g[:1]), "grad"),
    "grad per-step wrong length": (lambda j, g: (j, torch.randn(2, 4, 3, dtype=torch.float64)), "grad"),
    "grad 1d": (lambda j, g: (j, g[0]), "grad"),
    "grad int": (lambda j, g: (j, g.long()), "grad"),
    "jacobians int": (lambda j, g: (j.long(), g), "jacobians_t"),
    "grad not a tensor": (lambda j, g: (j, g.tolist()), "grad"),
    "jacobians a list of dense": (lambda j, g: ([j], g), "jacobians_t"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCAN))
def test_bad_scan_inputs_one_line_error_naming_argument(case):
    make, argument = BAD_SCAN[case]
    jac, grad = make(*_good_scan())
    kind, message = _error_of(lambda: lightning_bppsa.backprop_scan(jac, grad, algorithm="linear"))
    assert kind in (ValueError, TypeError, RuntimeError), (case, kind, message)
    assert "\n" not in message.strip(), f"{case}: multi-line error {message!r}"
    assert argument in message, f"{case}: {message!r} does not name {argument}"


@pytest.mark.parametrize("bad", ["", "Linear", "parallel", None, 3])
def test_bad_scan_algorithm_names_argument(bad):
    kind, message = _error_of(lambda: lightning_bppsa.backprop_scan(*_good_scan(), algorithm=bad))
    assert kind in (ValueError, TypeError), (bad, kind, message)
    assert "algorithm" in message and "\n" not in message.strip(), message


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_scan_mixed_dtypes_and_scan_ref(algorithm):
    """float32 Jacobians with a float64 grad: either a clear error naming an argument, or scan_ref's answer."""
    jac, grad = _good_scan()
    kind, message = _error_of(lambda: lightning_bppsa.backprop_scan(jac.float(), grad, algorithm=algorithm))
    if kind is not None:
        assert "\n" not in message.strip() and ("grad" in message or "jacobians_t" in message), message
        return
    out = lightning_bppsa.backprop_scan(jac.float(), grad, algorithm=algorithm)
    ref = lightning_bppsa.scan_ref(jac.float().double(), grad, algorithm=algorithm)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- low precision and non-finite inputs


def _outputs_and_grads(module, x):
    x = x.clone().requires_grad_()
    out, h_n = module(x)
    loss = out.sin().sum() + sum(s.sum() for s in (h_n if isinstance(h_n, tuple) else (h_n,)))
    return [out, *torch.autograd.grad(loss, [x, *module.parameters()])]


@pytest.mark.parametrize("kind", sorted(TORCH_TYPES))
def test_bfloat16_as_close_to_float64_as_torchs_bfloat16(kind):
    from lightning_bppsa.testing import assert_derived_close

    ref64, _ = _pair(kind, "linear", 5, input_size=4, hidden_size=6)
    x = torch.randn(30, 2, 4, dtype=torch.float64)
    ours = convert(copy.deepcopy(ref64).bfloat16())
    ours.algorithm = "linear"
    actual = _outputs_and_grads(ours, x.bfloat16())
    assert ours.last_stats["path"] == "scan", ours.last_stats
    baseline = _outputs_and_grads(copy.deepcopy(ref64).bfloat16(), x.bfloat16())
    for i, (a, r, b) in enumerate(zip(actual, _outputs_and_grads(ref64, x), baseline, strict=True)):
        assert_derived_close(a, r, b, name=f"{kind}[{i}]")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("kind", sorted(TORCH_TYPES))
def test_non_finite_input_same_nan_pattern_as_torch(kind, value):
    ref, ours = _pair(kind, "blelloch", 2, input_size=4, hidden_size=6)
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    x[2, 1, 0] = value
    for i, (a, r) in enumerate(zip(_outputs_and_grads(ours, x), _outputs_and_grads(ref, x), strict=True)):
        assert torch.equal(a.isnan(), r.isnan()), f"{kind}[{i}]: NaNs in other places than torch's"
        torch.testing.assert_close(a.nan_to_num(), r.nan_to_num(), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- nn.Recurrence with torch's own cells


class _DropCell(nn.Module):
    """torch's GRUCell with dropout on its input: random numbers drawn inside the cell."""

    def __init__(self):
        super().__init__()
        self.cell, self.drop = nn.GRUCell(3, 5), nn.Dropout(0.3)

    def forward(self, x, h):
        return self.cell(self.drop(x), h)


CELLS = {
    "RNNCell": lambda: nn.RNNCell(3, 5),
    "GRUCell": lambda: nn.GRUCell(3, 5),
    "LSTMCell": lambda: nn.LSTMCell(3, 5),
    "dropout GRUCell": _DropCell,
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("name", sorted(CELLS))
def test_recurrence_of_torch_cells_equals_a_plain_loop(name, algorithm):
    from lightning_bppsa.nn import Recurrence

    torch.manual_seed(4)
    cell = CELLS[name]().double().train()
    x = torch.randn(1, 11, 3, dtype=torch.float64)  # B=1, batch first
    state0 = torch.randn(1, 5, dtype=torch.float64)
    state0 = (state0, state0.cos()) if name == "LSTMCell" else state0
    weights = torch.randn(1, 11, 5, dtype=torch.float64)

    def grads(run):
        xs = x.clone().requires_grad_()
        s0 = tuple(s.clone().requires_grad_() for s in state0) if isinstance(state0, tuple) else \
            state0.clone().requires_grad_()
        cell.zero_grad(set_to_none=True)
        torch.manual_seed(9)
        out = run(xs, s0)
        (out * weights).sum().backward()
        return [out, xs.grad, *(s.grad for s in (s0 if isinstance(s0, tuple) else (s0,)))] + [
            p.grad for p in cell.parameters()]

    def loop(xs, s0):
        outs, state = [], s0
        for t in range(xs.shape[1]):
            state = cell(xs[:, t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs, 1)

    def compare(rec):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fallback warns; its result is what is checked here
            ours = grads(lambda xs, s0: rec(xs, s0)[0])
        for i, (a, r) in enumerate(zip(ours, grads(loop), strict=True)):
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, i=i: f"{name}[{i}]: {m}")
        return rec.last_stats

    with layer_plan.measurements(True):  # "auto" decides as a user's would: measured on the call's data
        stats = compare(Recurrence(cell, batch_first=True, algorithm=algorithm))
    if "dropout" in name:  # documented: a cell that draws random numbers replays the loop under autograd
        assert stats["path"] == "autograd" and "random numbers" in stats["reason"], stats
    elif stats["path"] != "scan":
        # "auto" measured the scan slower here and ran the loop: the scan is compared too, asked for by name
        assert algorithm == "auto" and stats["path"] == "autograd", stats
        assert stats["reason"].startswith(("auto:", "measured:")), stats
        assert compare(Recurrence(cell, batch_first=True, algorithm="chunked"))["path"] == "scan"
