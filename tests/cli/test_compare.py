"""``lightning-bppsa compare``: two runs, one folder per comparison, table, plot, TensorBoard scalars."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from lightning_bppsa.callbacks import BackwardTimer

from lightning_bppsa.bench import measure
from lightning_bppsa.bench.trial import WARM_UP_KEY, NotMeasurable, WarmUp
from lightning_bppsa.cli.compare import (
    INCOMPLETE,
    Interrupted,
    TakeTurns,
    Turns,
    _build_run,
    autograd_step_timer,
    compare,
    torch_threads,
)
from lightning_bppsa.cli.config import CLIError, find_recipe
from lightning_bppsa.cli.report import CHECK_SECONDS, read_scalars


def _recorded(hooked: type, calls: list[tuple[str, str]]):
    """``hooked.on_train_batch_start``, recording (thread name, class name) before it runs."""
    hook = hooked.on_train_batch_start

    def recorded(self, *args) -> None:
        calls.append((threading.current_thread().name, hooked.__name__))
        hook(self, *args)

    return recorded


@pytest.mark.slow
def test_compare_writes_both_runs_the_table_the_plot_and_the_scalars(
    workdir: Path, tiny: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[tuple[str, str]] = []  # (run's thread, hook) of every step's first hooks, in call order
    for hooked in (WarmUp, TakeTurns, BackwardTimer):
        monkeypatch.setattr(hooked, "on_train_batch_start", _recorded(hooked, starts))
    autograd, bppsa = compare(
        "rnn_bitstream", max_steps=6, check_every=3, threads=1, block_steps=2, save_dir="runs", overrides=tiny
    )
    out = workdir / "runs" / "rnn_bitstream" / "compare" / "version_0"
    for label in ("autograd", "bppsa"):
        assert list((out / label).glob("events.out.tfevents.*")), label
    assert not (out / INCOMPLETE).exists()
    assert autograd.seconds["backward"] > 0 and bppsa.seconds["backward"] > 0
    assert (
        [step for step, _, _ in autograd.loss_curve]
        == [step for step, _, _ in bppsa.loss_curve]
        == list(range(6))
    )
    assert autograd.loss_curve[0][2] == pytest.approx(bppsa.loss_curve[0][2], rel=1e-5)  # same seed
    assert {"val/loss", "val/acc", "train/loss"} <= set(bppsa.final)
    # the plot's clock is the running sum of the step times whose median the table reports
    # ... less the seconds of the gradient checks (steps 0 and 3)
    logged = read_scalars(bppsa.log_dir)
    checks = {step: value for _, step, value in logged[CHECK_SECONDS]}
    step_times = [value - checks.get(step, 0.0) for _, step, value in logged["time/step"]]
    assert sorted(checks) == [0, 3] and [seconds for _, seconds, _ in bppsa.loss_curve] == pytest.approx(
        [sum(step_times[: i + 1]) for i in range(6)]
    )
    table = (out / "compare.md").read_text()
    for row in ("forward ms/step", "backward ms/step", "total ms/step", "final val/acc"):
        assert row in table
    assert "max gradient rel. diff vs autograd (2 checks, " in table
    assert [step for step, _ in bppsa.grad_rel_diff] == [0, 3] and max(
        v for _, v in bppsa.grad_rel_diff
    ) < 1e-4
    out_text = capsys.readouterr().out
    assert "backward ms/step" in out_text and "training in turns of 2 steps, 1 torch thread(s)" in out_text
    assert "torch threads: 1 (--threads)" in out_text  # given: not measured
    # each run warmed up before its first step, outside the medians and the clock, and says so in a row
    for run in (autograd, bppsa):
        assert len(read_scalars(run.log_dir)[WARM_UP_KEY]) == 1 and run.warm_up_seconds > 0
    for run in ("compare-autograd", "compare-bppsa"):  # outside the first block and the first step's clock
        assert [hook for thread, hook in starts if thread == run][:3] == [
            "WarmUp",
            "TakeTurns",
            "BackwardTimer",
        ]
    assert (
        "| one-time warm-up s (kernel builds: a forward + backward before step 0, outside the medians and the clock) |"
        in table
    )
    assert "autograd: step 2/6" in out_text and "bppsa: step 4/6" in out_text
    assert out_text.count("BPPSA conversion") <= 1  # fit then validate: the table once (it is logged)
    assert (out / "loss_vs_time.png").read_bytes().startswith(b"\x89PNG")
    # the runs took turns every 2 steps; the checked steps (0, 3) are not among the medians' steps
    assert sorted(bppsa.per_step["step"]) == [1, 2, 4, 5] and bppsa.check_seconds > 0
    assert "| first step with a train-loss gap > 0.0001 |  | none |  |" in table
    assert "per block of 2 steps: median (range of 3)" in table and "| torch threads | 1 | 1 |  |" in table
    assert "| load average (1, 5, 15 min) at start; at end |" in table
    scalars = read_scalars(bppsa.log_dir)
    for key in ("backward", "step"):
        (logged,) = scalars[f"compare/{key}_speedup"]
        assert logged[2] == pytest.approx(autograd.seconds[key] / bppsa.seconds[key], rel=1e-6)
    assert "bppsa/grad_rel_diff" in scalars and "bppsa/grad_rel_diff" not in read_scalars(autograd.log_dir)


@pytest.mark.slow
def test_an_interrupted_comparison_stays_marked_and_the_next_one_gets_its_own_folder(
    workdir: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    timer_end, abort, aborted = BackwardTimer.on_train_batch_end, Turns.abort, threading.Event()

    def ctrl_c_in_the_bppsa_run(self, trainer, pl_module, *args) -> None:
        timer_end(self, trainer, pl_module, *args)
        if trainer.strategy.strategy_name == "bppsa" and trainer.global_step == 2:
            _thread.interrupt_main()  # Ctrl-C: a KeyboardInterrupt in the main thread
            # the run goes on only once the main thread has answered it (else a fast run could finish first)
            assert aborted.wait(timeout=60), "the main thread did not answer Ctrl-C"

    def noted_abort(self) -> None:
        aborted.set()
        abort(self)

    monkeypatch.setattr(BackwardTimer, "on_train_batch_end", ctrl_c_in_the_bppsa_run)
    monkeypatch.setattr(Turns, "abort", noted_abort)
    # Python's Ctrl-C handler even where SIGINT came ignored (a job started with `&`): interrupt_main does
    # nothing to an ignored signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with pytest.raises(SystemExit):  # compare answers Ctrl-C as Lightning does, with sys.exit(1)
        compare("rnn_bitstream", max_steps=5, check_every=0, block_steps=1, save_dir="runs", overrides=tiny)
    root = workdir / "runs" / "rnn_bitstream" / "compare"
    assert (root / "version_0" / INCOMPLETE).exists()
    out, err = capsys.readouterr()
    assert "version_0 stays marked INCOMPLETE" in err
    assert "measured autograd forward + backward " in out  # no --threads: the thread count was measured
    monkeypatch.undo()
    monkeypatch.chdir(workdir)

    autograd, bppsa = compare("rnn_bitstream", max_steps=4, check_every=0, save_dir="runs", overrides=tiny)
    assert "ignoring runs/rnn_bitstream/compare/version_0: marked INCOMPLETE" in capsys.readouterr().out
    assert Path(bppsa.log_dir) == Path("runs/rnn_bitstream/compare/version_1/bppsa")
    assert (root / "version_0" / INCOMPLETE).exists() and not (root / "version_1" / INCOMPLETE).exists()
    # only this comparison's events: one loss per step, no step of the interrupted run mixed in
    for run in (autograd, bppsa):
        assert [step for step, _, _ in run.loss_curve] == [0, 1, 2, 3]
    assert "max train-loss gap at the same step |  | " in (root / "version_1" / "compare.md").read_text()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--trainer.strategy=auto"], "compare sets --trainer.strategy itself"),
        (["--trainer.strategy", "auto"], "compare sets --trainer.strategy itself"),
        (["--trainer.strategy.algorithm=chunked"], "--trainer.strategy=...`"),
        (["--trainer.logger=false"], "compare sets --trainer.logger itself"),
        (["--trainer.logger", "false"], "choose where they go with --save-dir"),
        (["--trainer.max_steps=3"], "use --max-steps"),
    ],
)
def test_options_compare_sets_itself_are_refused_before_any_run(
    workdir: Path, tiny: list[str], override: list[str], message: str
) -> None:
    with pytest.raises(CLIError, match="compare sets") as error:
        compare("rnn_bitstream", max_steps=2, save_dir="runs", overrides=[*tiny, *override])
    assert message in str(error.value)
    assert not (workdir / "runs").exists() and not (workdir / "cache").exists()


def test_compare_needs_a_budget(workdir: Path) -> None:
    with pytest.raises(CLIError, match="--max-steps"):
        compare("rnn_bitstream", max_steps=0)


@pytest.mark.parametrize(
    "budget", [{"max_epochs": -1}, {"max_steps": -5}, {"max_epochs": 0, "max_steps": 10}]
)
def test_a_negative_or_zero_budget_is_refused_not_read_as_unlimited(workdir: Path, budget: dict) -> None:
    with pytest.raises(CLIError, match=">= 1"):
        compare("rnn_bitstream", **budget)
    assert not (workdir / "runs").exists()


def test_runs_take_turns_block_by_block_and_stop_together() -> None:
    turns, order = Turns(2), []

    def run(index: int, blocks: int) -> None:
        turns.wait(index)
        for block in range(blocks):
            order.append((index, block))
            time.sleep(0.001)  # a chance for the other thread to run, were the turns not kept
            turns.hand_on(index, finished=block == blocks - 1)
            if block < blocks - 1:
                turns.wait(index)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in ((0, 3), (1, 2))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]  # A/B/A/B, then A alone

    stopped = Turns(2)
    stopped.abort()
    with pytest.raises(Interrupted):
        stopped.wait(1)
    with pytest.raises(Interrupted):
        stopped.check()


def test_compare_refuses_bad_threads_and_blocks(workdir: Path) -> None:
    with pytest.raises(CLIError, match="--threads must be >= 1; got 0"):
        compare("rnn_bitstream", max_steps=2, threads=0)
    with pytest.raises(CLIError, match="--block-steps must be >= 1; got 0"):
        compare("rnn_bitstream", max_steps=2, block_steps=0)


def test_threads_given_are_not_measured_and_measured_ones_follow_the_measurements(capsys) -> None:
    def no_timer(cli: object):
        raise AssertionError("--threads was given: nothing may be measured")

    assert torch_threads(3, object(), timer=no_timer) == (3, "torch threads: 3 (--threads)")
    timed: list[object] = []

    def timer(cli: object):
        timed.append(cli)
        return {1: 0.055, 2: 0.359, 3: 0.02}.__getitem__  # the 2-vCPU collapse at 2 threads

    cli = object()
    assert torch_threads(None, cli, timer=timer, cpus=2) == (
        1, "torch threads: 1 (measured autograd forward + backward 55 ms at 1 thread, 359 ms at 2; "
        "--threads to override)",
    )  # fmt: skip
    assert torch_threads(None, cli, timer=timer, cpus=3)[0] == 3 and timed == [cli, cli]


def test_threads_fall_back_to_the_physical_cores_where_no_step_can_be_measured(monkeypatch) -> None:
    def unmeasurable(cli: object):
        raise NotMeasurable("manual optimization: its training_step steps the optimizers itself")

    monkeypatch.setattr("lightning_bppsa.cli.compare.default_threads", lambda: 2)
    assert torch_threads(None, object(), timer=unmeasurable, cpus=4) == (
        2, "torch threads: 2 (one per physical core; not measured: manual optimization: its training_step "
        "steps the optimizers itself; --threads to override)",
    )  # fmt: skip


def test_the_thread_measurement_times_a_copy_and_leaves_the_run_untouched(
    workdir: Path, tiny: list[str]
) -> None:
    path = find_recipe("rnn_bitstream")
    cli = _build_run("auto", ["--config", str(path), *tiny, "--trainer.logger=false"], "runs", 0, path)
    weights = {k: v.clone() for k, v in cli.model.state_dict().items()}
    rng = torch.get_rng_state()
    readings = iter([0.0, 5.0, 10.0, 10.5, 20.0, 22.0, 30.0, 30.1])  # step times 5 (untimed), 0.5, 2, 0.1
    threads = torch.get_num_threads()
    try:
        seconds_at = autograd_step_timer(cli, steps=3, clock=lambda: next(readings))
        assert seconds_at(1) == 0.5 and torch.get_num_threads() == 1  # the median of the timed steps
    finally:
        measure.set_threads(threads)
    assert torch.equal(torch.get_rng_state(), rng) and cli.datamodule.tensors is None  # its data not set up
    assert all(torch.equal(v, weights[k]) for k, v in cli.model.state_dict().items())
    assert all(p.grad is None for p in cli.model.parameters())
