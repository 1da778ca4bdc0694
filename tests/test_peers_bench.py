"""benchmarks/peers.py: every arm measured on tiny sizes, the table's structure, the compile budget, the CLI.

Times come from injected clocks (one tick per timed call), never from the machine.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def ticking(step: float):
    """A clock that advances by ``step`` at every reading."""
    counter = itertools.count()
    return lambda: next(counter) * step


def _arms(result):
    return {arm["key"]: arm for arm in result["arms"]}


def test_rows_time_every_arm_with_the_injected_clocks_and_render(peers) -> None:
    result = peers.measure_workload(
        peers.WORKLOADS["smoke-gru"], rounds=3, compile_budget=0, clock=ticking(1e-3), cpu_clock=ticking(5e-4)
    )
    arms = _arms(result)
    assert list(arms) == list(peers.ARMS)
    assert result["workload"] == "GRU smoke B=1 T=7 input 3" and len(result["load_before"]) == 3
    for key in ("autograd", "ours"):
        arm = arms[key]
        # one tick per timed turn: the clocks were injected into every timing; a step turn is 5 calls
        assert (
            arm["status"] == "ok"
            and arm["step_ms"] == pytest.approx(0.2)
            and arm["cold_step_ms"] == pytest.approx(1.0)
            and arm["iqr_ms"] == pytest.approx(0, abs=1e-9)
        )
        assert arm["forward_ms"] == pytest.approx(1.0) and arm["cores"] == pytest.approx(0.5)
        assert arm["check"] == "ok" and arm["backward_ops"] > 0 and arm["compile_s"] is None
    assert arms["autograd"]["rel_diff"] == 0 and arms["ours"]["rel_diff"] < 1e-5
    assert arms["ours"]["path"].startswith("scan")
    assert arms["compile"]["status"] == arms["ours_compile"]["status"] == "not run (--compile-budget 0)"
    assert arms["jax"]["status"] == "jax not installed"

    table = peers.render([result], ["# title"]).splitlines()
    assert table[0] == "# title"
    every = table.index("## Every arm")
    assert table[every + 2].startswith("| workload | threads | arm | forward ms | step ms |")
    assert len(table[every + 2].split("|")) == len(table[every + 3].split("|"))
    body = table[every + 4 : every + 9]
    labels = [line.split(" | ")[2] for line in body]
    assert labels[2] == f"lightning_bppsa ({arms['ours']['path']})"  # what our module ran
    assert [label.split(" (")[0] for label in labels] == list(peers.ARMS.values())
    assert all(len(line.split("|")) == len(table[every + 2].split("|")) for line in body)  # same columns
    speedup = table[-1].split(" | ")
    assert speedup[2:7] == ["1.00x", "—", "—", "—", "1.00x"]  # vs autograd, arms that did not run, cold


@pytest.mark.slow
def test_compile_over_budget_is_reported_and_longer_rows_skip_it(peers) -> None:
    over_budget: dict[str, int] = {}
    # 100 s per clock reading: every compiled warm-up "takes" longer than the 50 s budget
    result = peers.measure_workload(
        peers.WORKLOADS["smoke-rnn"], rounds=2, compile_budget=50, backend="aot_eager",
        over_budget=over_budget, clock=ticking(100.0),
    )  # fmt: skip
    arms = _arms(result)
    for key in ("compile", "ours_compile"):
        assert arms[key]["status"] == f"compile exceeded the budget of 50 s ({peers.ARMS[key]}, aot_eager)"
    assert over_budget == {"compile": [9, "RNN smoke"], "ours_compile": [9, "RNN smoke"]}
    longer = peers.WORKLOADS["smoke-gru"]._replace(length=11)  # another cell, a longer unrolled graph
    arms = _arms(peers.measure_workload(longer, rounds=2, compile_budget=50, over_budget=over_budget))
    assert arms["compile"]["status"] == "skipped: compile exceeded the budget at T=9 (RNN smoke)"
    assert arms["autograd"]["status"] == "ok"


@pytest.mark.slow
def test_compiled_arms_are_timed_and_checked(peers) -> None:
    arms = _arms(peers.measure_workload(peers.WORKLOADS["smoke-rnn"], rounds=2, backend="aot_eager"))
    for key in ("compile", "ours_compile"):
        assert arms[key]["status"] == "ok" and arms[key]["check"] == "ok" and arms[key]["compile_s"] >= 0
        assert arms[key]["backward_ops"] is None  # a compiled backward is not counted


@pytest.mark.slow
@pytest.mark.parametrize("row", ["smoke-rnn", "smoke-gru", "smoke-lstm"])
def test_jax_computes_torchs_loss_and_gradients(peers, row: str) -> None:
    jax = pytest.importorskip("jax", reason="the JAX arm needs the [bench] extra")
    result = peers.measure_workload(peers.WORKLOADS[row], rounds=2, compile_budget=0, jax=jax)
    arm = _arms(result)["jax"]
    assert arm["status"] == "ok" and arm["check"] == "ok" and arm["rel_diff"] < 1e-5


def test_without_jax_one_line_says_so(peers, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "jax", None)  # import jax raises ImportError
    assert peers._import_jax() is None
    assert capsys.readouterr().err.strip().splitlines() == [
        "jax is not installed (pip install 'lightning-bppsa[bench]'): no JAX arm"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rows", "rnn-b16-t1000,nope"], "--rows: unknown ['nope']"),
        (["--threads", "0"], "--threads must be positive"),
        (["--threads", "two"], "--threads must be comma-separated integers"),
        (["--rounds", "1"], "--rounds must be at least 2"),
        (["--block", "0"], "--block must be at least 1"),
        (["--compile-budget", "-1"], "--compile-budget must be >= 0"),
    ],
)
def test_bad_arguments_are_named(peers, capsys, argv, message) -> None:
    with pytest.raises(SystemExit):
        peers.main(argv)
    assert message in capsys.readouterr().err


def test_row_selection(peers) -> None:
    assert peers._parse(["--quick"]).rows == ["rnn-b16-t1000", "gru-l"]
    assert peers._parse(["--smoke"]).rows == ["smoke-rnn", "smoke-gru", "smoke-lstm"]
    full = peers._parse([])
    assert full.rows == peers.FULL and full.threads == [1, 2] and full.rounds == 15
    assert len(full.rows) == 8 and not any(row.startswith("smoke") for row in full.rows)


@pytest.mark.slow
def test_smoke_command_writes_the_table(peers, tmp_path) -> None:
    out = tmp_path / "peers.md"
    table = peers.main(
        ["--smoke", "--rows", "smoke-rnn", "--threads", "1", "--compile-budget", "0", "--out", str(out)]
    )
    assert out.read_text() == table
    lines = table.splitlines()
    assert lines[0] == "# The whole training step against every peer (CPU)"
    assert any(line.startswith("Machine: ") and "1 threads" in line for line in lines)
    rows = [line for line in lines if line.startswith("| RNN smoke B=2 T=9 input 1 | 1 |")]
    assert len(rows) == 6  # five arms and one speedup row
