"""convert(trace=True): layer chains written as forward() code become SparseChains, the model unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from lightning_bppsa.nn import ConversionRecord, SparseChain, convert
from lightning_bppsa.strategy import format_conversion_table


class Functional(nn.Module):
    """A conv net written as calls: modules, functional forms and a method, one residual branch."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.weight2 = nn.Parameter(torch.randn(4, 3, 2, 2) * 0.3)  # used by F.conv2d
        self.head = nn.Linear(4 * 2 * 2, 5)
        self.side = nn.Linear(5, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, stride=2)
        x = F.conv2d(x, self.weight2, None, 1, 0).relu()
        x = torch.flatten(torch.tanh(x), 1)
        x = torch.sigmoid(F.linear(x, self.head.weight, self.head.bias))
        return x + self.side(x)  # x has two users: the chain ends before them


def test_functional_chain_is_rewritten_and_the_model_behaves_exactly_like_the_original():
    original = Functional().double()
    params = list(original.parameters())
    report: list[ConversionRecord] = []
    traced = convert(original, report=report, trace=True)
    assert isinstance(traced, fx.GraphModule) and isinstance(traced.bppsa_chain_0, SparseChain)
    assert [type(m).__name__ for m in traced.bppsa_chain_0] == [
        "Conv2d",
        "ReLU",
        "MaxPool2d",
        "Conv2d",
        "ReLU",
        "Tanh",
        "Flatten",
        "Linear",
        "Sigmoid",
    ]
    assert {id(p) for p in traced.parameters()} == {id(p) for p in params}  # the same Parameter objects
    assert traced.bppsa_chain_0[3].weight is original.weight2
    assert report == [
        ConversionRecord(
            "<root>",
            "Functional",
            True,
            "traced Functional.forward: sparse BPPSA scan over bppsa_chain_0 (conv1, relu, max_pool2d, "
            "conv2d, relu_1, tanh, flatten, linear, sigmoid); left on autograd: [side]: chain without Conv2d "
            "(Linear): dense Jacobians, the sparse scan cannot pay off",
        )
    ]
    x = torch.randn(3, 2, 7, 6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(traced(x), original(x), atol=0, rtol=0)
    grad_out = torch.randn(3, 5, dtype=torch.float64)
    actual = torch.autograd.grad(traced(x), [x, *params], grad_out)  # the same Parameters in both
    assert traced.bppsa_chain_0.last_stats["path"] == "scan"
    expected = torch.autograd.grad(original(x), [x, *params], grad_out)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_without_trace_the_report_says_where_the_chain_is_and_how_to_find_it():
    model = nn.Sequential(Functional())
    report: list[ConversionRecord] = []
    convert(model, report=report)
    assert type(model[0]) is Functional
    assert [(r.path, r.scanned) for r in report] == [("0", False)]
    assert "calls conv1 from forward() code" in report[0].reason and "trace=True" in report[0].reason
    assert "no supported module found" not in format_conversion_table(report)  # the strategy's log


class Branchy(Functional):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: fx cannot trace it
            x = -x
        return super().forward(x)


class WithMethod(Functional):
    def features(self, x):
        return self.conv1(x)


class Short(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)

    def forward(self, x):
        return F.relu(self.conv(x)).sum(dim=(2, 3))


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (Branchy(), "torch.fx could not trace Branchy.forward: TraceError"),
        (WithMethod(), "not traced: WithMethod defines features besides forward"),
        (Short(), "no chain qualifies: [conv, relu]: chain of 2 layers: shorter than MIN_LAYERS=3"),
    ],
    ids=["untraceable", "methods", "short"],
)
def test_modules_left_alone_say_what_was_looked_at_and_why(model, reason):
    parent = nn.Sequential(model)
    report: list[ConversionRecord] = []
    convert(parent, report=report, trace=True)
    assert parent[0] is model
    assert [(r.path, r.scanned) for r in report] == [("0", False)] and reason in report[0].reason


def test_nested_module_is_replaced_in_its_parent_with_hooks_and_parameters():
    parent = nn.Sequential(Functional().double(), nn.Tanh())
    params = list(parent.parameters())
    calls = []
    parent[0].register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    convert(parent, trace=True)
    assert isinstance(parent[0], fx.GraphModule)
    parent(torch.randn(2, 2, 7, 6, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert calls == ["TracedFunctional"] and {id(p) for p in parent.parameters()} == {id(p) for p in params}
    assert all(p.grad is not None for p in params)
