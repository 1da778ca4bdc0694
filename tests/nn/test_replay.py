"""Scan steps replayed from CUDA graphs (lightning_bppsa.nn._replay), over the host emulation of the graphs:
gradients equal torch's, and a graph runs again only where nothing holds what it handed out."""

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_bppsa import layer_plan
from lightning_bppsa import nn as bnn
from lightning_bppsa.nn import _replay, recurrent
from lightning_bppsa.testing import OpCounter, assert_derived_close, graphs_on_cpu

PAIRS = {"RNN": (bnn.RNN, nn.RNN), "GRU": (bnn.GRU, nn.GRU), "LSTM": (bnn.LSTM, nn.LSTM)}


@pytest.fixture
def graphs(monkeypatch):
    """The emulated graphs, "auto" deciding for the scan (the model sure, nothing measured)."""
    monkeypatch.setattr(recurrent, "_predict", lambda shape: (1e-3, 1e-2))
    layer_plan.forget()
    with graphs_on_cpu() as emulated, layer_plan.measurements(False):
        yield emulated
    layer_plan.forget()


def _pair(cell, **kw):
    ours_cls, torch_cls = PAIRS[cell]
    ours = ours_cls(3, 5, batch_first=True, algorithm="auto", dtype=torch.float64, **kw)
    ref = torch_cls(3, 5, batch_first=True, dtype=torch.float64, **kw)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _loss(outputs):
    output, states = outputs
    h_n = states[0] if isinstance(states, tuple) else states
    return (output**2).sum() + h_n.sin().sum()


def _check_grads(ours, ref, x_ours, x_ref):
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert_derived_close(p.grad, q.grad, name=name)
    if x_ref.grad is not None:
        assert_derived_close(x_ours.grad, x_ref.grad, name="input")


@pytest.mark.parametrize("cell", list(PAIRS))
@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True}])
def test_replayed_steps_give_torchs_gradients(graphs, cell, kw):
    ours, ref = _pair(cell, **kw)
    for step in range(4):  # the first call decides, the second captures, the third a second graph, then reuse
        x = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = ours(x)
        _loss(out).backward()
        _loss(ref(x_ref)).backward()
        _check_grads(ours, ref, x, x_ref)
        assert_derived_close(out[0], ref(x_ref)[0], name="output")
        replayed = "replayed from CUDA graphs" in ours.last_stats["plan"]
        assert replayed == (step > 0), ours.last_stats["plan"]
    # steps 1 and 2 captured a forward and a backward graph each (step 1's outputs were held during step 2)
    assert graphs.captures == 4


def test_outputs_kept_by_the_caller_are_never_overwritten(graphs, caplog):
    ours, ref = _pair("GRU")
    x1, x2, x3 = (torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3))
    ours(x1)  # decides (eager)
    with caplog.at_level("INFO", logger=_replay.__name__):
        held = [ours(x)[0] for x in (x1, x2, x3)]  # two graphs, then every graph busy: the eager scan
    assert graphs.captures == 4
    assert "replayed" not in ours.last_stats["plan"]
    assert "every CUDA graph of it is busy" in caplog.text
    for out, x in zip(held, (x1, x2, x3), strict=True):
        assert_derived_close(out, ref(x)[0], name="held output")
    # accumulated over the three calls: every graph's backward on its own states
    sum(o.sum() for o in held).backward()
    sum(ref(x)[0].sum() for x in (x1, x2, x3)).backward()
    _check_grads(ours, ref, x1, x1)


def test_gradients_accumulate_without_zeroing_between_steps(graphs):
    """A .grad that took a replay's gradient holds that graph: the next backward adds into it, not over it.
    Every other step's loss leaves h_n unused (its gradient None: zero, not the last step's)."""
    ours, ref = _pair("LSTM")
    for step in range(5):
        x = torch.randn(3, 4, 3, dtype=torch.float64)
        loss = _loss if step % 2 else lambda outputs: outputs[0].square().sum()
        loss(ours(x)).backward()
        loss(ref(x)).backward()
    _check_grads(ours, ref, x, x)


@pytest.mark.parametrize(("cell", "which"), [("RNN", 0), ("LSTM", 2)])
def test_an_output_modified_in_place_recomputes_and_matches_torch(graphs, monkeypatch, cell, which):
    """``which``: the output modified (0 the sequence, 2 the LSTM's c_n)."""
    recomputed = []
    recompute = _replay.StepGraphs.recomputed_backward
    monkeypatch.setattr(
        _replay.StepGraphs, "recomputed_backward", lambda *args: recomputed.append(1) or recompute(*args)
    )
    ours, ref = _pair(cell)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    ours(x), ours(x)  # decided, captured
    flat = _replay._flat(ours(x))
    assert "replayed" in ours.last_stats["plan"]
    expected = _replay._flat(ref(x))
    for outputs in (flat, expected):
        outputs[which].mul_(2.0)
        sum(o.sum() for o in outputs).backward()
    _check_grads(ours, ref, x, x)
    assert recomputed == [1]  # the graph's states may be stale (on a GPU the backward graph reads them)


def test_retain_graph_and_double_backward_match_torch(graphs):
    ours, ref = _pair("GRU")
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ours(x), ours(x)
    loss = _loss(ours(x))
    assert "replayed" in ours.last_stats["plan"]
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = _loss(ref(x_ref))
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    _check_grads(ours, ref, x, x_ref)
    # a gradient penalty: the second derivative through the recomputed scan
    (g,) = torch.autograd.grad(_loss(ours(x)), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(_loss(ref(x_ref)), x_ref, create_graph=True)
    ours.zero_grad(), ref.zero_grad()
    g.square().sum().backward()
    g_ref.square().sum().backward()
    _check_grads(ours, ref, x, x_ref)


def test_new_weight_storage_captures_anew_and_module_limit_holds(graphs):
    ours, ref = _pair("RNN")
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    for _ in range(3):
        ours(x)
    assert graphs.captures == 2
    with torch.no_grad():  # the same Parameter objects over new storage (a replay would read the old)
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            p.data = p.data * 0.5
            q.copy_(p)
    ours(x)
    out, _ = ours(x)  # the first call's outputs dropped: its graph again
    assert graphs.captures == 4
    assert_derived_close(out, ref(x)[0], name="output over the new weights")
    for length in range(6, 12):  # new call keys: graphs of other keys make room, at most the module's limit
        ours(torch.randn(2, length, 3, dtype=torch.float64))
        ours(torch.randn(2, length, 3, dtype=torch.float64))
    assert len(_replay.kept(ours)) <= _replay.GRAPHS_PER_MODULE


def test_what_cannot_replay_runs_the_eager_scan(graphs, monkeypatch):
    ours, _ = _pair("LSTM", num_layers=2, dropout=0.5)
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with OpCounter():  # a dispatch mode sees every op
        for _ in range(3):
            ours(x)
    monkeypatch.setattr(_replay, "REPLAY_ELEMENTS", 2 * 5 * 5 * 2 - 1)  # one element too many
    for _ in range(3):
        ours(x)
    assert graphs.captures == 0 and "replayed" not in ours.last_stats["plan"]
    monkeypatch.setattr(_replay, "REPLAY_ELEMENTS", 2 * 5 * 5 * 2)
    ours(x)
    ours(x)
    assert graphs.captures == 2 and "replayed" in ours.last_stats["plan"]


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
@pytest.mark.parametrize("change_output", [False, True])
def test_dropout_draws_at_every_replay_what_torch_draws_from_the_same_seed(graphs, cell, change_output):
    """Dropout between layers in training mode replays, drawing afresh each step: with the same seed before
    each step, outputs and gradients equal torch's (its masks), the capturing step's too (the capture's own
    draws leave the random state alone); an output modified in place recomputes the call with the masks its
    replay drew; evaluation mode replays graphs of its own, without dropout."""
    ours, ref = _pair(cell, num_layers=3, dropout=0.4, bidirectional=True)
    for step in range(4):  # the first call decides, the second captures, the third a second graph, then reuse
        x = torch.randn(4, 6, 3, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        found = []
        for module, inputs in ((ours, x), (ref, x_ref)):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            output, states = module(inputs)
            if module is ours:
                plan = ours.last_stats["plan"]  # (a recomputing backward writes its own)
            if change_output:
                output.mul_(2)  # torch's layer saved no output: the in-place change is allowed there too
            found.append(output.detach().clone())
            _loss((output, states)).backward()
        assert_derived_close(found[0], found[1], name="output")
        _check_grads(ours, ref, x, x_ref)
        assert ("replayed from CUDA graphs" in plan) == (step > 0), plan
    torch.manual_seed(0)
    first = ours(x)[0].detach().clone()
    assert not torch.equal(first, ours(x)[0]), "two replays drew the same masks"
    ours.eval()
    ref.eval()
    assert_derived_close(ours(x)[0], ref(x)[0], name="evaluation output")
    assert ours(x)[0].requires_grad and "replayed" in ours.last_stats["plan"]


def test_two_shapes_in_turn_with_validation_between_steps_replay(graphs):
    """The module keeps the decisions of its last MEMO_KEYS call keys: two batch shapes in turn, each step followed
    by a call without gradients (validation: another key), answer from the memo and replay from the third step
    on (each key captured once), with torch's gradients and outputs."""
    ours, ref = _pair("GRU")
    shapes = [(2, 5, 3), (3, 4, 3)]
    replayed = []
    for step in range(6):
        x = torch.randn(*shapes[step % 2], dtype=torch.float64)
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = ours(x)
        replayed.append("replayed from CUDA graphs" in ours.last_stats["plan"])
        _loss(out).backward()
        _loss(ref(x)).backward()
        _check_grads(ours, ref, x, x)
        with torch.no_grad():
            assert_derived_close(ours(x)[0], ref(x)[0], name="validation output")
    assert replayed == [False, False, True, True, True, True]
    assert graphs.captures == 2 * 2 + 2  # a forward and a backward graph a training key, a forward one a validation key
    assert len(ours._plan_memo) == recurrent.MEMO_KEYS == 4


def test_no_cuda_graphs_runs_the_eager_scan_and_replays_again_after(graphs):
    ours, ref = _pair("LSTM")
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with bnn.no_cuda_graphs(), bnn.no_cuda_graphs():  # nested blocks compose
        for _ in range(3):
            ours.zero_grad(set_to_none=True)
            _loss(ours(x)).backward()
            assert "replayed" not in ours.last_stats["plan"]
        with bnn.no_cuda_graphs():
            pass
        ours(x)
        assert graphs.captures == 0 and "replayed" not in ours.last_stats["plan"]
    ref.zero_grad(set_to_none=True)
    _loss(ref(x)).backward()
    _check_grads(ours, ref, x, x)
    ours.zero_grad(set_to_none=True)
    _loss(ours(x)).backward()
    assert graphs.captures == 2 and "replayed from CUDA graphs" in ours.last_stats["plan"]
    _check_grads(ours, ref, x, x)


def test_the_decision_times_the_replayed_step_and_drops_graphs_it_does_not_take(monkeypatch):
    layer_plan.forget()
    timed = []

    def measure(forwards, wrt, device):  # each path's step run once; torch's declared the faster
        for name, forward in forwards.items():
            forward()
            timed.append(name)
        return {"scan": 2e-3, "autograd": 1e-3}

    monkeypatch.setattr(recurrent, "_predict", lambda shape: (1e-3, 1.1e-3))  # unsure: measured
    monkeypatch.setattr(recurrent, "time_training_steps", measure)
    ours, _ = _pair("RNN")
    with graphs_on_cpu() as graphs, layer_plan.measurements(True):
        ours(torch.randn(2, 5, 3, dtype=torch.float64))
    layer_plan.forget()
    assert timed == ["scan", "autograd"]
    assert graphs.captures == 2  # the scan's step was timed replayed ...
    assert ours.last_stats["path"] == "autograd" and not _replay.kept(ours)  # ... and its graphs dropped


def test_a_module_with_graphs_pickles_and_copies_without_them(graphs):
    """The graphs live beside the module: torch.save / deepcopy of a trained module work, and a copy captures
    its own (its weights' memory, not the original's)."""
    ours, ref = _pair("GRU")
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    for _ in range(3):
        ours(x)
    assert len(_replay.kept(ours)) == 1
    clone = pickle.loads(pickle.dumps(ours))
    twin = copy.deepcopy(ours)
    for module in (clone, twin):
        assert not _replay.kept(module)
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(0.5)
        for _ in range(3):
            out, _ = module(x)
        assert "replayed" in module.last_stats["plan"]
        with torch.no_grad():
            for p, q in zip(ref.parameters(), module.parameters(), strict=True):
                p.copy_(q)
        assert_derived_close(out, ref(x)[0], name="the copy's output")


def test_the_least_recently_used_free_graphs_make_room(graphs, monkeypatch):
    monkeypatch.setattr(_replay, "GRAPHS_PER_MODULE", 2)
    ours, _ = _pair("RNN")
    a, b, c = (torch.randn(2, length, 3, dtype=torch.float64) for length in (4, 5, 6))

    def twice(x):  # a memo miss (decided), then a replay (captured the first time)
        ours(x)
        ours(x)

    twice(a), twice(b), twice(a)
    assert graphs.captures == 4  # a's and b's pairs, a's replayed again
    twice(c)  # room made by b's pair, the least recently used
    twice(a)
    assert graphs.captures == 6 and len(_replay.kept(ours)) == 2
    twice(b)
    assert graphs.captures == 8


def test_a_module_whose_keys_keep_changing_stops_capturing(graphs, monkeypatch, caplog):
    monkeypatch.setattr(_replay, "MAX_CAPTURES", 2)
    ours, ref = _pair("GRU")
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    with caplog.at_level("INFO", logger=_replay.__name__):
        for _ in range(4):
            with torch.no_grad():  # new storage for the same Parameters each step (as a sharding wrapper's)
                for p in ours.parameters():
                    p.data = p.data.clone()
            out, _ = ours(x)
            ours(x)
    assert graphs.captures == 4  # two pairs, then none
    assert len(_replay._KEPT[ours]) == 2  # no entry for the keys never captured (a key a call: no growth)
    assert "captured CUDA graphs 2 times" in caplog.text
    assert_derived_close(out, ref(x)[0], name="output")


@pytest.mark.parametrize("cell", ["GRU", "LSTM"])
def test_truncated_backpropagation_through_time_replays_with_the_carried_state(graphs, cell):
    """A long sequence in chunks, each chunk's initial state the last one's final state detached (the state
    a plain tensor or an LSTM's pair); then a learnt initial state that needs its own gradient."""
    ours, ref = _pair(cell, num_layers=2)
    state = ref_state = None
    for _ in range(6):  # two chunks eager (no state, then the first state: decided), then two graphs alternate
        x = torch.randn(3, 5, 3, dtype=torch.float64)
        ours.zero_grad(), ref.zero_grad()
        out, state = ours(x, state)
        expected, ref_state = ref(x, ref_state)
        _loss((out, state)).backward()
        _loss((expected, ref_state)).backward()
        _check_grads(ours, ref, x, x)
        state = tuple(s.detach() for s in state) if cell == "LSTM" else state.detach()
        ref_state = tuple(s.detach() for s in ref_state) if cell == "LSTM" else ref_state.detach()
    assert "replayed" in ours.last_stats["plan"] and graphs.captures == 4
    learnt = [torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True) for _ in range(2 if cell == "LSTM" else 1)]
    learnt_ref = [s.detach().clone().requires_grad_() for s in learnt]
    for _ in range(3):
        for s in (*learnt, *learnt_ref):
            s.grad = None
        outputs = ours(x, tuple(learnt) if cell == "LSTM" else learnt[0])
        _loss(outputs).backward()
        _loss(ref(x, tuple(learnt_ref) if cell == "LSTM" else learnt_ref[0])).backward()
        for s, r in zip(learnt, learnt_ref, strict=True):
            assert_derived_close(s.grad, r.grad, name="initial state")
    assert "replayed" in ours.last_stats["plan"]


def test_autocast_on_and_off_replay_their_own_graphs(graphs):
    """Under autocast the layers round their outputs to its dtype (explicit casts, autocast off inside): its
    state is part of a graph's key, so turning it off replays float32 graphs, not the bfloat16 ones."""
    ours, ref = _pair("RNN")
    ours.float(), ref.float()
    x = torch.randn(2, 5, 3)
    captured = []
    for autocast, dtype in ((True, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16)):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out, h_n = ours(x)
                expected, _ = ref(x)
            out.float().square().sum().backward()
        assert "replayed" in ours.last_stats["plan"] and out.dtype == expected.dtype == dtype
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        captured.append(graphs.captures)
    assert captured == [4, 8, 8]  # two pairs each way (the last output held), the third round the first's


def test_calls_without_gradients_replay_the_forward_kernel_alone(graphs):
    """Inference (validation): a memoised forward-kernel call replays a forward graph of its own (no backward
    captured), outputs equal torch's; a kept output is not overwritten; no_grad and inference_mode take
    separate graphs (tensors made under inference mode take no copy outside it)."""
    ours, ref = _pair("LSTM", num_layers=2)
    ours.eval(), ref.eval()
    xs = [torch.randn(3, 6, 3, dtype=torch.float64) for _ in range(4)]
    with torch.no_grad():
        kept = [ours(x) for x in xs]  # decided, captured, a second graph (the first's outputs kept), eager
        assert graphs.captures == 2 and "replayed" not in ours.last_stats["plan"]
        for x, outputs in zip(xs, kept, strict=True):
            for got, expected in zip(_replay._flat(outputs), _replay._flat(ref(x)), strict=True):
                assert_derived_close(got, expected, name="output")
        del kept
        out, _ = ours(xs[0])
        assert ours.last_stats["plan"] == "forward kernel (no gradient needed), replayed from CUDA graphs"
    with torch.inference_mode():
        ours(xs[1])  # captured under inference mode
        out, _ = ours(xs[1])
    assert graphs.captures == 3 and "replayed" in ours.last_stats["plan"]
    assert_derived_close(out, ref(xs[1])[0], name="output under inference mode")
