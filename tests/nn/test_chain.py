"""SparseChain gradients (input and parameters) equal autograd's; the converter's choices."""

import copy
import re

import pytest
import torch
from torch import nn

from lightning_bppsa import layer_plan
from lightning_bppsa.nn import ConversionRecord, SparseChain, convert, reference_backward
from lightning_bppsa.testing import assert_derived_close


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 3, (2, 3), stride=(1, 2), padding="valid"),
        nn.LeakyReLU(0.1),
        nn.AvgPool2d(2, 1, padding=1),
        nn.Conv2d(3, 3, 3, groups=3, dilation=2, padding="same", bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 3, 5),
        nn.Sigmoid(),
    ).double()


def grads(model, x, grad_out):
    params = [p for p in model.parameters()]
    return torch.autograd.grad(model(x), [x, *params], grad_out)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "auto"])
@pytest.mark.parametrize("batch", [1, 3])
def test_chain_gradients_equal_autograd(algorithm, batch):
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference, algorithm=algorithm)
    x = torch.randn(batch, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    out = reference(x)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(chain(x), out, atol=0, rtol=0)
    for actual, expected in zip(grads(chain, x, grad_out), grads(reference, x, grad_out), strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=1e-9)


def test_dropout_and_batchnorm_eval_match_the_reference_backward():
    chain = SparseChain(
        nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3).eval(), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(3, 2, 2)
    ).double()
    with torch.no_grad():
        chain[1].running_var.uniform_(0.5, 2)
        chain[1].weight.normal_()
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    out = chain(x)  # one forward, one dropout mask, differentiated twice
    grad_out = torch.randn_like(out)
    wrt = [x, *chain.parameters()]
    scanned = torch.autograd.grad(out, wrt, grad_out, retain_graph=True)
    with reference_backward():
        expected = torch.autograd.grad(out, wrt, grad_out)
    for actual, exp in zip(scanned, expected, strict=True):
        torch.testing.assert_close(actual, exp, atol=1e-9, rtol=1e-9)


def test_input_without_grad_and_frozen_parameters():
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference)
    reference[0].weight.requires_grad_(False)
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64)
    trainable = [p for p in chain.parameters() if p.requires_grad]
    out = chain(x)
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad(reference(x), trainable, grad_out)
    for actual, exp in zip(torch.autograd.grad(out, trainable, grad_out), expected, strict=True):
        torch.testing.assert_close(actual, exp, atol=1e-9, rtol=1e-9)


def test_float32_gradients_are_close_to_float64():
    reference = small_cnn()
    chain = SparseChain.from_sequential(copy.deepcopy(reference)).float()
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, dtype=torch.float64)
    expected = grads(reference, x, grad_out)
    x32 = x.detach().float().requires_grad_()
    baseline = grads(copy.deepcopy(reference).float(), x32, grad_out.float())  # torch's own float32 error
    for actual, exp, base in zip(grads(chain, x32, grad_out.float()), expected, baseline, strict=True):
        assert_derived_close(actual, exp, base)


def test_training_mode_batchnorm_falls_back_to_autograd():
    chain = SparseChain(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()).double().train()
    x = torch.randn(3, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    chain(x).sum().backward()
    assert chain._last_patterns is None and x.grad is not None


def test_flop_report_of_the_last_forward():
    chain = SparseChain.from_sequential(small_cnn())
    with pytest.raises(RuntimeError, match="forward"):
        chain.flop_report()
    chain(torch.randn(1, 2, 8, 10, dtype=torch.float64, requires_grad=True))
    bp = [r for r in chain.flop_report() if r.method == "bp"]
    assert len(bp) == len(chain)


def test_converter_wraps_conv_chains_and_keeps_parameters():
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2)),  # converted
        nn.Flatten(),
        nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)),  # dense: stays
        nn.Sequential(nn.GRU(2, 2)),  # not a chain of supported layers: recursed into
    )
    params = list(model.parameters())
    keys = list(model.state_dict())
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert isinstance(model[0], SparseChain)
    assert type(model[2]) is nn.Sequential and type(model[3]) is nn.Sequential
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert list(model.state_dict()) == keys
    rows = {r.path: r for r in report}
    assert rows["0"].scanned and not rows["2"].scanned and "Conv2d" in rows["2"].reason
    assert "3" not in rows


def test_converter_leaves_short_and_batchnorm_chains():
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU()),
    )
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert all(type(m) is nn.Sequential for m in model)
    reasons = {r.path: r.reason for r in report}
    assert "MIN_LAYERS" in reasons["0"] and "BatchNorm2d" in reasons["1"]


def test_last_stats_say_what_the_last_forward_and_backward_did():
    chain = SparseChain.from_sequential(small_cnn(), algorithm="blelloch")
    assert chain.last_stats == {}
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    out = chain(x)
    stats = chain.last_stats
    assert stats["path"] == "scan" and stats["algorithm"] == "blelloch" and stats["layers"] == len(chain)
    assert stats["linearize_seconds"] > 0 and stats["scan_seconds"] == stats["param_seconds"] == 0
    out.sum().backward()
    assert stats["scan_seconds"] > 0 and stats["param_seconds"] > 0

    with torch.no_grad():
        chain(x)
    assert chain.last_stats["path"] == "autograd" and chain.last_stats["linearize_seconds"] == 0
    assert stats["path"] == "scan"  # a new forward gets a new dict; the old one keeps its numbers

    with reference_backward():
        chain(x).sum().backward()
    assert chain.last_stats["path"] == "scan" and chain.last_stats["scan_seconds"] == 0


def test_maxpool_with_indices_keeps_its_tuple_on_autograd_and_the_converter_says_why():
    layers = [nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2, return_indices=True)]
    chain = SparseChain(*layers).double()
    x = torch.randn(2, 1, 6, 6, dtype=torch.float64, requires_grad=True)
    values, indices = chain(x)
    expected_values, expected_indices = nn.Sequential(*layers)(x)
    assert chain.last_stats["path"] == "autograd"
    torch.testing.assert_close(values, expected_values, atol=0, rtol=0)
    assert torch.equal(indices, expected_indices)

    model = nn.Sequential(nn.Sequential(*layers))
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert type(model[0]) is nn.Sequential
    assert not report[0].scanned and "return_indices" in report[0].reason


def _penalty_grads(model, x):
    params = list(model.parameters())
    first = torch.autograd.grad((model(x) ** 2).sum(), [x, *params], create_graph=True)
    return torch.autograd.grad(sum((g**2).sum() for g in first), [x, *params])


def test_gradient_penalty_equals_torchs():
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference)
    x = torch.randn(1, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    actual = _penalty_grads(chain, x)
    assert chain.last_stats["path"] == "scan"
    for i, (a, b) in enumerate(zip(actual, _penalty_grads(reference, x), strict=True)):
        assert a is not None, f"gradient #{i} is None"
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_torch_func_grad_and_jit_script_equal_torchs():
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference)
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64)

    def func_grads(model):
        params = {k: v.detach() for k, v in model.named_parameters()}
        return torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)

    actual, expected = func_grads(chain), func_grads(reference)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=1e-12, rtol=1e-12)
    scripted = torch.jit.script(chain)
    assert [id(p) for p in scripted.parameters()] == [id(p) for p in chain.parameters()]
    torch.testing.assert_close(scripted(x), reference(x), atol=0, rtol=0)


def test_layers_with_hooks_stay_on_autograd_so_their_hooks_run():
    chain = SparseChain.from_sequential(small_cnn())
    seen = []
    handle = chain[0].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    chain(x).sum().backward()
    assert seen == [(2, 4, 8, 10)] and chain.last_stats["path"] == "autograd"
    handle.remove()
    chain(x)
    assert chain.last_stats["path"] == "scan"

    model = small_cnn()
    model[3].register_forward_pre_hook(lambda module, args: None)
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert type(model) is nn.Sequential and "layer 3, Conv2d has hooks" in report[0].reason


def test_empty_batch_and_meta_device_like_torch():
    reference = small_cnn()
    chain = SparseChain.from_sequential(copy.deepcopy(reference))
    for model in (chain, reference):
        x = torch.randn(0, 2, 8, 10, dtype=torch.float64, requires_grad=True)
        model(x).sum().backward()
        assert x.grad.shape == x.shape
    assert chain.last_stats["path"] == "autograd"
    meta = SparseChain.from_sequential(small_cnn().to("meta"))
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, device="meta", requires_grad=True)
    meta(x).sum().backward()  # no values to scan: the layers' own forward and backward, as on meta in torch
    assert x.grad.shape == x.shape and meta.last_stats["path"] == "autograd"


# everyday mistakes: (input shape, input dtype); small_cnn takes (B, 2, 8, 10) float64
MISTAKES = {
    "Linear input size": ((2, 2, 8, 9), torch.float64),
    "Conv2d channels": ((2, 3, 8, 10), torch.float64),
    "input dtype": ((2, 2, 8, 10), torch.float32),
    "5-D input": ((2, 2, 1, 8, 10), torch.float64),
    "MaxPool2d window larger than its input": ((2, 2, 1, 1), torch.float64),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_everyday_mistakes_raise_torchs_own_error(mistake):
    shape, dtype = MISTAKES[mistake]
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference)
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    with pytest.raises(Exception) as expected:
        reference(x)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        chain(x)


@pytest.mark.slow
def test_compile_fullgraph_runs_the_layers_forward_and_equals_torch():
    reference = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()).double()
    chain = SparseChain.from_sequential(reference)
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    compiled = torch.compile(chain, fullgraph=True, backend="aot_eager")  # dynamo + AOTAutograd, no C++ build
    actual = torch.autograd.grad((compiled(x) ** 2).sum(), [x, *chain.parameters()])
    expected = torch.autograd.grad((reference(x) ** 2).sum(), [x, *reference.parameters()])
    assert chain.last_stats["path"] == "autograd"  # the sparse scan is not traceable: documented fallback
    for a, b in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def _conv_relu_pool(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2)).to(dtype)


@pytest.mark.parametrize("algorithm", ["linear", "blelloch", "chunked", "auto"])
def test_every_algorithm_runs_the_chain_exactly(algorithm):
    reference = small_cnn()
    chain = SparseChain.from_sequential(reference, algorithm=algorithm)
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 5, dtype=torch.float64)
    for actual, expected in zip(grads(chain, x, grad_out), grads(reference, x, grad_out), strict=True):
        torch.testing.assert_close(actual, expected, atol=1e-9, rtol=1e-9)
    assert chain.last_stats["path"] == "scan" and chain.last_stats["algorithm"] == algorithm


def test_layers_the_scan_cannot_take_run_on_autograd_with_the_reason():
    """Reflect padding, BatchNorm2d on batch statistics in eval mode: torch's gradients, the reason said."""
    layers = {
        "padding_mode": nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
        "track_running_stats=False": nn.BatchNorm2d(2, track_running_stats=False).eval(),
    }
    for expected_reason, layer in layers.items():
        reference = nn.Sequential(
            layer,
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(layer.num_features if isinstance(layer, nn.BatchNorm2d) else 3, 2, 1),
        ).double()
        chain = SparseChain.from_sequential(reference)
        x = torch.randn(3, 2, 6, 6, dtype=torch.float64, requires_grad=True)
        grad_out = torch.randn_like(reference(x))
        for actual, expected in zip(grads(chain, x, grad_out), grads(reference, x, grad_out), strict=True):
            torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        stats = chain.last_stats
        assert (
            stats["path"] == "autograd"
            and stats["reason"].startswith("layer 0")
            and expected_reason in stats["reason"]
        )


def test_converter_leaves_chains_the_scan_cannot_take_and_the_model_trains():
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), nn.ReLU(), nn.MaxPool2d(2))
    )
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert type(model[0]) is nn.Sequential
    assert not report[0].scanned and "layer 0, Conv2d with padding_mode='reflect'" in report[0].reason
    model(torch.randn(2, 2, 6, 6, requires_grad=True)).sum().backward()


def test_autocast_bfloat16_scans_in_float32_with_gradients_in_the_inputs_dtypes():
    reference = _conv_relu_pool(torch.float32)
    chain = SparseChain.from_sequential(copy.deepcopy(reference))
    x = torch.randn(2, 1, 9, 9, requires_grad=True)
    truth_model = copy.deepcopy(reference).double()
    x64 = x.detach().double().requires_grad_()
    out64 = truth_model(x64)
    grad_out = torch.randn_like(out64)
    truth = torch.autograd.grad(out64, [x64, *truth_model.parameters()], grad_out)
    results = []
    for model in (chain, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        assert y.dtype == torch.bfloat16
        results.append(torch.autograd.grad(y.float(), [x, *model.parameters()], grad_out.float()))
    assert chain.last_stats["path"] == "scan" and chain.last_stats["scan_dtype"] == "torch.float32"
    for actual, baseline, expected in zip(*results, truth, strict=True):
        assert actual.dtype == baseline.dtype == torch.float32
        assert_derived_close(actual, expected, baseline)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_chains_scan_in_float32_and_say_so(dtype):
    reference = _conv_relu_pool(dtype)
    chain = SparseChain.from_sequential(copy.deepcopy(reference))
    x64 = torch.randn(2, 1, 9, 9, dtype=torch.float64)
    grad_out = torch.randn(2, 3, 3, 3, dtype=torch.float64)
    truth_model = copy.deepcopy(reference).double()
    x64.requires_grad_()
    truth = torch.autograd.grad(truth_model(x64), [x64, *truth_model.parameters()], grad_out)
    x = x64.detach().to(dtype).requires_grad_()
    actual = grads(chain, x, grad_out.to(dtype))
    baseline = grads(reference, x, grad_out.to(dtype))
    assert chain.last_stats["path"] == "scan" and chain.last_stats["scan_dtype"] == "torch.float32"
    for a, b, t in zip(actual, baseline, truth, strict=True):
        assert a.dtype == dtype
        assert_derived_close(a, t, b)


def test_nan_in_the_forward_and_the_gradient_like_torchs_relu_backward():
    linear = nn.Linear(4, 4).double()
    with torch.no_grad():
        linear.bias[2] = -100.0  # the second ReLU masks entry 2 of every sample
    reference = nn.Sequential(nn.ReLU(), linear, nn.ReLU(), nn.Tanh())
    chain = SparseChain.from_sequential(reference, algorithm="blelloch")
    x = torch.randn(3, 4, dtype=torch.float64)
    x[0, 1] = float("nan")
    x.requires_grad_()
    grad_out = torch.randn(3, 4, dtype=torch.float64)
    grad_out[1:, 2] = float("nan")
    expected = grads(reference, x, grad_out)
    assert expected[0][1:].isfinite().all()
    for a, e in zip(grads(chain, x, grad_out), expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12, equal_nan=True)
    assert chain.last_stats["path"] == "scan"


def test_input_by_keyword_like_nn_sequential():
    chain = SparseChain(nn.Linear(3, 2).double())
    t = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(chain(input=t), chain[0](t), atol=0, rtol=0)


def test_unbatched_input_runs_like_torch_on_autograd():
    reference = _conv_relu_pool()
    chain = SparseChain.from_sequential(reference)
    x = torch.randn(1, 9, 9, dtype=torch.float64, requires_grad=True)  # torch's unbatched (C, H, W)
    grad_out = torch.randn(3, 3, 3, dtype=torch.float64)
    for a, e in zip(grads(chain, x, grad_out), grads(reference, x, grad_out), strict=True):
        torch.testing.assert_close(a, e, atol=0, rtol=0)
    assert "does not take a 3-dim input as a batch" in chain.last_stats["reason"]


def test_unknown_algorithm_is_refused_when_the_chain_is_built():
    with pytest.raises(ValueError, match=r"algorithm must be one of \('linear', 'blelloch', 'chunked', 'auto'\)"):
        SparseChain(nn.ReLU(), algorithm="tree")


def test_repr_says_it_is_the_bppsa_version_and_lists_the_layers():
    text = repr(SparseChain(nn.Conv2d(1, 2, 3), nn.ReLU(), algorithm="blelloch"))
    assert text.splitlines()[0] == "SparseChain(BPPSA sparse scan, algorithm='blelloch')("
    assert "(0): Conv2d(1, 2" in text and "(1): ReLU()" in text


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports a CUDA device: what the chain's path rule reads (no GPU here)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_auto_on_cuda_unmeasured_keeps_cudnn_autograd_with_the_reason_and_an_algorithm_forces_the_scan():
    # measurements are off in the tests (conftest): no model prices a chain, and on CUDA the scan measured 13-65x
    # slower than cuDNN, so an unmeasured chain there runs cuDNN's autograd; elsewhere the scan it was converted to
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    on_cuda = torch.Tensor._make_subclass(_OnCuda, x.detach(), True)
    auto = SparseChain(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    auto(on_cuda)  # runs on the CPU: the rule reads the device the tensor reports
    reason = auto.last_stats["reason"]
    assert auto.last_stats["path"] == "autograd" and reason.startswith("auto: no model for layer chains on CUDA")
    assert "13-65x" in reason and "not measured (measurements off): torch's path" in reason
    forced = SparseChain(nn.Conv2d(3, 4, 3), nn.ReLU(), algorithm="chunked")
    assert forced._why_autograd(on_cuda, tuple(forced.parameters())) is None  # the scan (not run: no GPU)
    auto(x)
    assert auto.last_stats["path"] == "scan"  # CPU: the scan


@pytest.mark.parametrize(("scan_ms", "path"), [(2.0, "autograd"), (0.5, "scan")])
def test_auto_on_cuda_takes_the_faster_path_measured_once_per_shape(monkeypatch, scan_ms, path):
    # on CUDA "auto" measures as elsewhere (both whole forward + backward passes, on the call's device): the
    # measurement injected, the device it was asked for recorded
    asked = []

    def measure(forwards, wrt, device):
        asked.append((sorted(forwards), device.type))
        return {"scan": scan_ms * 1e-3, "autograd": 1e-3}

    monkeypatch.setattr(layer_plan, "time_training_steps", measure)
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    chain = SparseChain(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    on_cuda = torch.Tensor._make_subclass(_OnCuda, x.detach(), True)
    params = tuple(chain.parameters())
    decision = f"measured: scan {scan_ms:.3g} ms vs torch 1 ms a forward + backward"
    with layer_plan.measurements(True):
        plan = chain._auto(on_cuda, params)  # what forward asks (the scan itself cannot run here: no GPU)
        assert asked == [(["autograd", "scan"], "cuda")]
        assert (plan.path, plan.reason) == (path, decision)
        assert chain._auto(on_cuda, params) == plan and len(asked) == 1  # the same shape again: not measured
        if path == "autograd":  # the call runs cuDNN's path (here the CPU's) and says why
            chain(on_cuda)
            assert chain.last_stats["path"] == "autograd" and chain.last_stats["reason"] == f"auto: {decision}"
            assert len(asked) == 1


@pytest.mark.parametrize(("scan_ms", "path"), [(2.0, "autograd"), (0.5, "scan")])
def test_auto_takes_the_faster_path_measured_once_per_shape(monkeypatch, scan_ms, path):
    # off CUDA "auto" measures both whole forward + backward passes on the first call of a shape (the scan
    # measured 1.5-23x slower than autograd on VGG-11 on a CPU): an injected clock, scan first in each turn
    timed = []

    def timer(fn):
        fn()
        timed.append(fn)
        return 1e-3 if len(timed) % 2 == 0 else scan_ms * 1e-3

    monkeypatch.setattr(layer_plan, "device_timer", lambda device: timer)
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    reference = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(3, 2, 2)).double()
    chain = SparseChain.from_sequential(copy.deepcopy(reference))
    x = torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True)
    with layer_plan.measurements(True):
        torch.manual_seed(7)
        out = chain(x)
        assert len(timed) == 4  # two timed turns of each path
        assert chain.last_stats["path"] == path and chain.last_stats["decision"].startswith("measured")
        torch.manual_seed(7)
        expected = reference(x)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the measurement left the dropout draw alone
        grad_out = torch.randn_like(out)
        got = torch.autograd.grad(out, [x, *chain.parameters()], grad_out)
        want = torch.autograd.grad(expected, [x, *reference.parameters()], grad_out)
        for actual, exp in zip(got, want, strict=True):
            torch.testing.assert_close(actual, exp, atol=1e-9, rtol=1e-9)
        chain(x)  # the same shape again: no second measurement
        assert len(timed) == 4 and chain.last_stats["path"] == path
        chain(x[:1])  # another batch size: measured again
        assert len(timed) == 8


def test_auto_without_measurements_keeps_the_scan_and_says_why():
    chain = SparseChain.from_sequential(small_cnn())  # the suite runs with measurements off
    chain(torch.randn(2, 2, 8, 10, dtype=torch.float64, requires_grad=True))
    assert chain.last_stats["path"] == "scan"
    assert chain.last_stats["decision"].endswith("not measured (measurements off): the scan")


@pytest.mark.parametrize(("scan_ms", "checked"), [(2.0, False), (0.5, True)])
def test_a_shape_decided_for_autograd_skips_the_per_call_checks(monkeypatch, scan_ms, checked):
    # once "auto" has decided autograd for an input shape, nothing else could put the call on the scan: its calls
    # go straight to the layers (the checks cost ~30 us a call for VGG-11); a scan decision keeps checking
    monkeypatch.setattr(layer_plan, "time_training_steps", lambda *a: {"scan": scan_ms * 1e-3, "autograd": 1e-3})
    monkeypatch.setenv("BPPSA_PLAN_CACHE", "0")
    chain = SparseChain(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with layer_plan.measurements(True):
        chain(x)
        calls = []
        real = chain._why_autograd
        monkeypatch.setattr(chain, "_why_autograd", lambda *a: calls.append(a) or real(*a))
        out = chain(x)
    assert bool(calls) == checked
    assert chain.last_stats["path"] == ("scan" if checked else "autograd")
    if not checked:
        assert chain.last_stats["reason"] == "auto: measured: scan 2 ms vs torch 1 ms a forward + backward"
        assert out.grad_fn is not None and type(out.grad_fn).__name__ != "_ChainFunctionBackward"
