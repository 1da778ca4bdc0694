"""Trainer(strategy="bppsa"): same weights as "auto", Lightning features keep working."""

from __future__ import annotations

import copy
import gc
import logging
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_bppsa
from lightning_bppsa import BPPSADDPStrategy, BPPSAStrategy
from lightning_bppsa.nn import ConversionRecord
from lightning_bppsa.strategy import format_conversion_table, module_plan

CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}


class SeqModel(pl.LightningModule):
    """Embedding -> recurrent layer -> linear head; loss on the last step or on every step."""

    def __init__(
        self, cell="rnn", every_step=False, manual=False, lr=0.05, two_optimizers=False, compile_rnn=False
    ):
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.rnn = CELLS[cell](5, 6, batch_first=True)
        if compile_rnn:
            self.rnn = torch.compile(self.rnn)
        self.head = nn.Linear(6, 3)
        self.every_step, self.lr, self.two_optimizers = every_step, lr, two_optimizers
        self.automatic_optimization = not manual

    def loss(self, batch):
        tokens, labels = batch
        out, _ = self.rnn(self.embed(tokens))
        if self.every_step:
            logits = self.head(out)
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.repeat_interleave(out.shape[1]))
        return nn.functional.cross_entropy(self.head(out[:, -1]), labels)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        out, _ = self.rnn(self.embed(batch[0]))
        return self.head(out[:, -1])

    def configure_optimizers(self):
        if self.two_optimizers:
            rnn_params = list(self.rnn.parameters())
            rest = [p for n, p in self.named_parameters() if not n.startswith("rnn.")]
            return [torch.optim.SGD(rnn_params, lr=self.lr), torch.optim.Adam(rest, lr=self.lr / 10)]
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(length=13, samples=16, batch=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (samples, length), generator=g)
    labels = torch.randint(0, 3, (samples,), generator=g)
    return DataLoader(TensorDataset(tokens, labels), batch_size=batch)


def trainer(strategy, **kwargs):
    """A quiet float64 CPU Trainer (3 steps, no sanity validation) for ``strategy``; ``kwargs`` override."""
    defaults = dict(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision="64-true",
        num_sanity_val_steps=0,
    )
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def train(strategy, model_kwargs=None, data=None, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    model = SeqModel(**(model_kwargs or {}))
    trainer(strategy, **trainer_kwargs).fit(model, data or loader())
    return model


def assert_same_weights(a, b, rtol):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        err = ((pa - pb).norm() / pb.norm().clamp_min(1e-30)).item()
        assert err <= rtol, f"{name}: relative difference {err:.2e} > {rtol:.0e}"


def test_string_strategy_resolves_to_bppsa_on_the_accelerators_device():
    t = trainer("bppsa")
    assert isinstance(t.strategy, BPPSAStrategy)
    assert t.strategy.root_device == torch.device("cpu")


@pytest.mark.parametrize("strategy_cls", [BPPSAStrategy, BPPSADDPStrategy])
def test_bad_arguments_are_rejected(strategy_cls):
    with pytest.raises(ValueError, match="algorithm must be one of"):
        strategy_cls(algorithm="fastest")
    with pytest.raises(ValueError, match="check_every"):
        strategy_cls(check_every=-1)


def test_several_devices_under_bppsa_warn_and_point_to_bppsa_ddp():
    with pytest.warns(UserWarning, match="strategy='bppsa_ddp'"):
        t = trainer("bppsa", devices=2)
    assert isinstance(t.strategy, BPPSAStrategy) and t.strategy.root_device == torch.device("cpu")


def test_bppsa_ddp_resolves_devices_and_nodes():
    # resolved only: no process is launched before fit
    t = trainer("bppsa_ddp", devices=2, num_nodes=3)
    strategy = t.strategy
    assert type(strategy) is BPPSADDPStrategy and strategy.algorithm == "auto"
    assert (strategy.num_processes, strategy.num_nodes, strategy.world_size) == (2, 3, 6)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 6, "rank": 0}
    assert strategy.root_device == torch.device("cpu") and strategy._get_process_group_backend() == "gloo"
    custom = BPPSADDPStrategy("chunked", modules=["rnn"], check_every=5, find_unused_parameters=True)
    assert (custom.algorithm, custom.modules, custom.check_every) == ("chunked", ["rnn"], 5)
    assert custom._ddp_kwargs == {
        "find_unused_parameters": True
    }  # the rest goes on to DistributedDataParallel


def test_every_strategy_name_is_registered():
    from lightning.pytorch.strategies import StrategyRegistry

    expected = {
        "bppsa": BPPSAStrategy,
        "bppsa_ddp": BPPSADDPStrategy,
        "bppsa_model_parallel": lightning_bppsa.BPPSAModelParallelStrategy,
    }
    for name, cls in expected.items():
        assert type(StrategyRegistry.get(name)) is cls and cls.__name__ in lightning_bppsa.__all__, name


@pytest.mark.parametrize("cell", ["rnn", "gru", "lstm"])
@pytest.mark.parametrize("every_step", [False, True])
def test_automatic_optimization_matches_autograd_float64(cell, every_step):
    kwargs = dict(model_kwargs=dict(cell=cell, every_step=every_step))
    strategy = BPPSAStrategy(algorithm="chunked")  # force the scan even where "auto" would fall back
    assert_same_weights(train(strategy, **kwargs), train("auto", **kwargs), rtol=1e-9)


@pytest.mark.parametrize("clip", [("norm", 0.05), ("value", 0.01)])
def test_accumulation_and_clipping_match_autograd(clip):
    kwargs = dict(
        model_kwargs=dict(cell="gru"),
        accumulate_grad_batches=2,
        max_steps=2,
        gradient_clip_algorithm=clip[0],
        gradient_clip_val=clip[1],
    )
    assert_same_weights(
        train(BPPSAStrategy(algorithm="blelloch"), **kwargs), train("auto", **kwargs), rtol=1e-9
    )


@pytest.mark.parametrize("two_optimizers", [False, True])
def test_manual_optimization_matches_autograd(two_optimizers):
    kwargs = dict(model_kwargs=dict(cell="rnn", manual=True, two_optimizers=two_optimizers))
    assert_same_weights(
        train(BPPSAStrategy(algorithm="chunked"), **kwargs), train("auto", **kwargs), rtol=1e-9
    )


@pytest.mark.parametrize(("cell", "manual"), [("gru", False), ("lstm", True)])
def test_replayed_steps_under_lightnings_loop_match_autograd(monkeypatch, cell, manual):
    """Lightning's own loop over steps replayed from (emulated) CUDA graphs: zeroing to None, two batches
    accumulated a step (the first one's gradients held in .grad, aliases of a graph's memory, while the second
    replays), momentum SGD updating the captured weights in place, validation without gradients, manual
    optimisation; the weights after 4 steps equal plain autograd's, and the later steps did replay."""
    from lightning_bppsa import layer_plan
    from lightning_bppsa.nn import recurrent
    from lightning_bppsa.testing import graphs_on_cpu

    monkeypatch.setattr(recurrent, "_predict", lambda shape: (1e-3, 1e-2))  # "auto" sure of the scan
    kwargs = dict(model_kwargs=dict(cell=cell, manual=manual), max_steps=4, limit_val_batches=2,
                  val_check_interval=2, **({} if manual else {"accumulate_grad_batches": 2}))  # fmt: skip
    layer_plan.forget()
    try:
        with graphs_on_cpu() as graphs, layer_plan.measurements(False):
            replayed = train(BPPSAStrategy(), **kwargs)
    finally:
        layer_plan.forget()
    assert graphs.replays >= 4, (graphs.captures, graphs.replays)  # two steps replayed each way, at least
    assert replayed.rnn.last_stats["plan"].endswith("replayed from CUDA graphs"), replayed.rnn.last_stats
    assert_same_weights(replayed, train("auto", **kwargs), rtol=1e-9)


@pytest.mark.slow
def test_float32_matches_autograd():
    kwargs = dict(
        model_kwargs=dict(cell="gru", every_step=True), precision="32-true", data=loader(length=200)
    )
    assert_same_weights(
        train(BPPSAStrategy(algorithm="chunked"), **kwargs), train("auto", **kwargs), rtol=1e-4
    )


def test_bf16_mixed_trains_close_to_autograd():
    kwargs = dict(model_kwargs=dict(cell="rnn"), precision="bf16-mixed")
    assert_same_weights(
        train(BPPSAStrategy(algorithm="chunked"), **kwargs), train("auto", **kwargs), rtol=2e-2
    )


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_mixed_precision_on_cpu_keeps_the_accelerator_and_the_plugin(precision):
    # Lightning turns CPU "16-mixed" into bf16 autocast; the strategy must keep its plugin and the CPU.
    # "auto" keeps these short sequences on autograd; the forced scan under bf16 is the test above.
    from lightning.pytorch.plugins.precision import MixedPrecision

    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru")
    before = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*16-mixed.*not supported on CPU", category=UserWarning)
        t = trainer("bppsa", precision=precision, max_steps=2)
    plugin = t.strategy.precision_plugin
    assert isinstance(t.strategy, BPPSAStrategy) and t.strategy.root_device == torch.device("cpu")
    assert isinstance(plugin, MixedPrecision) and plugin.device == "cpu" and plugin.precision == "bf16-mixed"
    t.fit(model, loader())
    assert t.global_step == 2 and [(r.path, r.scanned) for r in t.strategy.conversion_report] == [
        ("rnn", True)
    ]
    for (name, p), q in zip(model.named_parameters(), before.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.isfinite(p).all() and not torch.equal(p, q), name


def test_parameters_stay_the_same_objects_and_table_is_reported():
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru")
    before = {name: id(p) for name, p in model.named_parameters()}
    strategy = BPPSAStrategy()
    trainer(strategy, max_steps=1).fit(model, loader())
    assert {name: id(p) for name, p in model.named_parameters()} == before
    assert [(r.path, r.scanned) for r in strategy.conversion_report] == [("rnn", True)]
    assert type(model.rnn).__module__.startswith("lightning_bppsa.nn")
    assert "rnn" in format_conversion_table(strategy.conversion_report)


def test_table_names_the_algorithm_the_strategy_set(caplog):
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru")
    with caplog.at_level(logging.INFO):
        trainer(BPPSAStrategy(algorithm="chunked"), max_steps=1).fit(model, loader())
    assert model.rnn.algorithm == "chunked"
    assert "BPPSA conversion (algorithm 'chunked')" in caplog.text
    assert "'auto'" not in caplog.text


def test_unsupported_configuration_stays_on_autograd_with_a_reason():
    class ProjModel(SeqModel):
        def __init__(self):
            super().__init__(cell="lstm")
            self.rnn = nn.LSTM(5, 6, batch_first=True, proj_size=4)
            self.head = nn.Linear(4, 3)

    pl.seed_everything(0, verbose=False)
    model = ProjModel()
    reference = copy.deepcopy(model)
    strategy = BPPSAStrategy()
    trainer(strategy).fit(model, loader())
    trainer("auto").fit(reference, loader())
    record = strategy.conversion_report[0]
    assert not record.scanned and "proj_size" in record.reason
    assert_same_weights(model, reference, rtol=1e-12)


@pytest.mark.slow
def test_compiled_submodule_is_converted_and_matches():
    kwargs = dict(model_kwargs=dict(cell="rnn", compile_rnn=True))
    assert_same_weights(
        train(BPPSAStrategy(algorithm="chunked"), **kwargs), train("auto", **kwargs), rtol=1e-9
    )


def test_hooks_run_once_per_backward_in_order():
    calls = []

    class Recorder(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            calls.append("before")

        def on_after_backward(self, trainer, pl_module):
            calls.append("after")

    train("bppsa", callbacks=[Recorder()], max_steps=2)
    assert calls == ["before", "after"] * 2


def test_user_backward_override_is_bypassed_with_a_warning():
    class Custom(SeqModel):
        def backward(self, loss, *args, **kwargs):
            raise AssertionError("must not be called")

    pl.seed_everything(0, verbose=False)
    with pytest.warns(UserWarning, match="backward is overridden"):
        trainer("bppsa", max_steps=1).fit(Custom(), loader())


def test_check_every_measures_the_gradient_difference():
    strategy = BPPSAStrategy(algorithm="chunked", check_every=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(strategy, max_steps=2)
    assert not [w for w in caught if "differ from autograd" in str(w.message)]
    assert strategy.last_gradient_difference is not None and strategy.last_gradient_difference < 1e-9


@pytest.mark.slow
def test_checkpoint_moves_between_strategies_and_plain_torch(tmp_path):
    kwargs = dict(enable_checkpointing=True, default_root_dir=tmp_path)
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="lstm")
    t = trainer("bppsa", **kwargs)
    t.fit(model, loader())
    path = tmp_path / "bppsa.ckpt"
    t.save_checkpoint(path)
    # into a plain torch model
    plain = SeqModel(cell="lstm").double()
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    assert_same_weights(plain, model, rtol=0)
    # resume under "auto" and under "bppsa": same weights after two more steps
    resumed = {}
    for name in ("auto", "bppsa"):
        pl.seed_everything(0, verbose=False)
        m = SeqModel(cell="lstm")
        trainer(name if name == "auto" else BPPSAStrategy(algorithm="chunked"), max_steps=5).fit(
            m, loader(), ckpt_path=path
        )
        resumed[name] = m
    assert_same_weights(resumed["bppsa"], resumed["auto"], rtol=1e-9)


def test_validation_and_predict_loops_run():
    """Validation inside fit, then validate and predict: what they return is torch's module's answer on the
    trained weights (the converted GRU runs its forward kernel there: no gradient is needed)."""
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru")
    t = trainer("bppsa", limit_val_batches=2, val_check_interval=2, max_steps=4)
    t.fit(model, loader(), loader())
    assert t.global_step == 4 and "val_loss" in t.callback_metrics  # validation ran inside fit
    twin = nn.GRU(5, 6, batch_first=True, dtype=torch.float64)
    twin.load_state_dict(model.rnn.state_dict())
    batches = list(loader())

    def torch_logits(tokens):
        with torch.no_grad():
            return model.head(twin(model.embed(tokens))[0][:, -1])

    (validated,) = t.validate(model, loader(), verbose=False)
    assert model.rnn.last_stats["path"] == "forward kernel"
    losses = [nn.functional.cross_entropy(torch_logits(x), y) for x, y in batches[:2]]  # limit_val_batches
    torch.testing.assert_close(validated["val_loss"], torch.stack(losses).mean().item(), rtol=1e-12, atol=0)
    predicted = t.predict(model, loader())
    assert len(predicted) == len(batches)
    torch.testing.assert_close(torch.cat(predicted), torch.cat([torch_logits(x) for x, _ in batches]))


def logged_tables(monkeypatch):
    """The conversion tables the strategy logs, in order."""
    tables = []
    monkeypatch.setattr(
        lightning_bppsa.strategy, "rank_zero_info", lambda message, *a, **k: tables.append(message)
    )
    return tables


@pytest.mark.parametrize("same_trainer", [True, False])
def test_validate_after_fit_keeps_the_conversion_report(monkeypatch, same_trainer):
    tables = logged_tables(monkeypatch)
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru")
    strategy = BPPSAStrategy(algorithm="chunked")
    t = trainer(strategy, max_steps=1)
    t.fit(model, loader())
    fitted = model.rnn
    report = list(strategy.conversion_report)
    if not same_trainer:
        t, strategy = trainer("bppsa"), None
    t.validate(model, loader(), verbose=False)
    assert model.rnn is fitted and model.rnn.algorithm == t.strategy.algorithm
    assert t.strategy.conversion_report == report == [report[0]]
    assert (report[0].path, report[0].scanned, report[0].already_converted) == ("rnn", True, False)
    # fit logs the table once, after its first backward, saying what each module ran; a validate under the
    # same strategy does not repeat it, one under a strategy with another algorithm logs its own
    assert len(tables) == (1 if same_trainer else 2)
    header, _, row = tables[0].splitlines()[1:4]
    assert header.split() == ["module", "type", "backward", "ran", "why"]
    assert row.split()[:4] == ["rnn", "GRU", "scan", "scan"] and row.split()[4].startswith("chunked")
    if not same_trainer:
        assert f"(algorithm {t.strategy.algorithm!r})" in tables[1].splitlines()[0]
        assert "no supported module" not in tables[1]
        row = next(line for line in tables[1].splitlines() if line.startswith("rnn "))
        assert row.split()[:3] == ["rnn", "GRU", "scan"]


def test_the_table_says_what_auto_resolved_to_or_why_a_module_ran_autograd():
    rnn = lightning_bppsa.nn.RNN(1, 3)
    assert module_plan(rnn) is None  # not run yet
    rnn.last_stats = {"path": "scan", "algorithm": "auto", "scan_algorithm": "linear"}
    assert module_plan(rnn) == "scan linear"
    rnn.last_stats = {"path": "autograd", "algorithm": "auto"}
    assert module_plan(rnn) == "autograd"
    rnn.last_stats = {"path": "autograd", "plan": "autograd (B >= 256: the scan does not pay)"}
    assert module_plan(rnn) == "autograd (B >= 256: the scan does not pay)"
    record = ConversionRecord("rnn", "RNN", True, "RNN: backward through the scan")
    table = format_conversion_table([record], "auto", {"rnn": module_plan(rnn)})
    header, _, row = table.splitlines()[1:]
    assert header.split() == ["module", "type", "backward", "ran", "why"]
    assert row.split()[:3] == ["rnn", "RNN", "scan"]
    assert row.index("autograd (B >= 256") == header.index("ran")  # the column lines up


def test_model_built_from_bppsa_modules_is_reported_as_scanned(monkeypatch):
    tables = logged_tables(monkeypatch)

    class Direct(SeqModel):
        def __init__(self):
            super().__init__(cell="gru")
            self.rnn = lightning_bppsa.nn.GRU(5, 6, batch_first=True)

    pl.seed_everything(0, verbose=False)
    strategy = BPPSAStrategy()
    trainer(strategy, max_steps=1).fit(Direct(), loader())
    assert [(r.path, r.scanned) for r in strategy.conversion_report] == [("rnn", True)]
    assert "already a BPPSA module" in tables[0] and "no supported module" not in tables[0]


def live_tensor_count():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


@pytest.mark.slow
def test_nothing_recorded_outlives_its_step():
    pl.seed_everything(0, verbose=False)
    model = SeqModel(cell="gru", every_step=True)
    data = loader(length=50, samples=64)
    t = trainer(BPPSAStrategy(algorithm="chunked"), max_steps=2)
    t.fit(model, data)
    after_two = live_tensor_count()
    t = trainer(BPPSAStrategy(algorithm="chunked"), max_steps=10)
    t.fit(model, data)
    assert live_tensor_count() <= after_two + 8  # optimizer state etc. may differ by a handful, not per step
    for module in model.modules():
        leftovers = [
            k
            for k, v in vars(module).items()
            if isinstance(v, torch.Tensor) and k not in ("_parameters", "_buffers")
        ]
        assert not leftovers, f"{type(module).__name__} keeps tensors {leftovers} between steps"


def test_reimport_keeps_registration():
    import importlib

    importlib.reload(lightning_bppsa)
    assert isinstance(trainer("bppsa").strategy, BPPSAStrategy)
