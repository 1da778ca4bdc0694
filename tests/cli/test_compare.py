"""``lightning-bppsa compare``: two runs, one folder per comparison, table, plot, TensorBoard scalars."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from lightning_bppsa.callbacks import BackwardTimer

from lightning_bppsa.cli.compare import INCOMPLETE, compare
from lightning_bppsa.cli.config import CLIError
from lightning_bppsa.cli.report import read_scalars


@pytest.mark.slow
def test_compare_writes_both_runs_the_table_the_plot_and_the_scalars(
    workdir: Path, tiny: list[str], capsys: pytest.CaptureFixture
) -> None:
    autograd, bppsa = compare("rnn_bitstream", max_steps=6, check_every=3, save_dir="runs", overrides=tiny)
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
    step_times = [value for _, _, value in read_scalars(bppsa.log_dir)["time/step"]]
    assert [seconds for _, seconds, _ in bppsa.loss_curve] == pytest.approx(
        [sum(step_times[: i + 1]) for i in range(6)]
    )
    table = (out / "compare.md").read_text()
    for row in ("forward ms/step", "backward ms/step", "total ms/step", "final val/acc"):
        assert row in table
    assert "max gradient rel. diff vs autograd (2 checks)" in table
    assert [step for step, _ in bppsa.grad_rel_diff] == [0, 3] and max(
        v for _, v in bppsa.grad_rel_diff
    ) < 1e-4
    assert "backward ms/step" in capsys.readouterr().out
    assert (out / "loss_vs_time.png").read_bytes().startswith(b"\x89PNG")
    scalars = read_scalars(bppsa.log_dir)
    for key in ("backward", "step"):
        (logged,) = scalars[f"compare/{key}_speedup"]
        assert logged[2] == pytest.approx(autograd.seconds[key] / bppsa.seconds[key], rel=1e-6)
    assert "bppsa/grad_rel_diff" in scalars and "bppsa/grad_rel_diff" not in read_scalars(autograd.log_dir)


@pytest.mark.slow
def test_an_interrupted_comparison_stays_marked_and_the_next_one_gets_its_own_folder(
    workdir: Path, tiny: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    timer_end = BackwardTimer.on_train_batch_end

    def ctrl_c_in_the_bppsa_run(self, trainer, pl_module, *args) -> None:
        timer_end(self, trainer, pl_module, *args)
        if trainer.strategy.strategy_name == "bppsa" and trainer.global_step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(BackwardTimer, "on_train_batch_end", ctrl_c_in_the_bppsa_run)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning answers Ctrl-C with sys.exit(1)
            compare("rnn_bitstream", max_steps=5, check_every=0, save_dir="runs", overrides=tiny)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after a Ctrl-C
    root = workdir / "runs" / "rnn_bitstream" / "compare"
    assert (root / "version_0" / INCOMPLETE).exists()
    assert "version_0 stays marked INCOMPLETE" in capsys.readouterr().err
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


@pytest.mark.parametrize("budget", [{"max_epochs": -1}, {"max_steps": -5}, {"max_epochs": 0, "max_steps": 10}])
def test_a_negative_or_zero_budget_is_refused_not_read_as_unlimited(workdir: Path, budget: dict) -> None:
    with pytest.raises(CLIError, match=">= 1"):
        compare("rnn_bitstream", **budget)
    assert not (workdir / "runs").exists()
