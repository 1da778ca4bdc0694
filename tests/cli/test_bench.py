"""``lightning-bppsa bench``: a grid from ``lightning_bppsa.bench`` -> CSV, markdown and plots."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_bppsa.cli import main, report
from lightning_bppsa.cli.bench import BENCHMARKS, bench
from lightning_bppsa.cli.config import CLIError


def _fake_rows(*, quick: bool = False, cell: str = "rnn") -> Iterator[dict]:
    for T in (10, 100):
        for B in (2, 16):
            path = "autograd" if (T, B) == (10, 16) else "scan"  # "auto" fell back to autograd there
            yield {
                "method": "autograd",
                "T": T,
                "B": B,
                "backward_s": 1e-3 * T,
                "cell": cell,
                "path": "autograd",
            }
            yield {
                "method": "bppsa", "T": T, "B": B, "backward_s": 1e-3 * T / 4, "cell": cell, "path": path,
                "speedup_min": 3.5, "speedup_max": 4.5,
            }  # fmt: skip


def test_bench_writes_csv_markdown_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(BENCHMARKS, "gru", (_fake_rows, {"cell": "gru"}))
    figures = []
    save = report._save_figure
    monkeypatch.setattr(
        report, "_save_figure", lambda fig, *a, **k: figures.append(fig) or save(fig, *a, **k)
    )
    out = bench("gru", quick=True, out=str(tmp_path / "results"), threads=1)
    rows = (out / "bench-gru.csv").read_text().splitlines()
    assert rows[0] == "method,T,B,backward_s,cell,path,speedup_min,speedup_max" and len(rows) == 9
    table = (out / "bench-gru.md").read_text()
    assert "| 10 | 2 | scan | 10.000 | 2.500 | 4.00x | 3.50-4.50x |" in table
    assert "| 10 | 16 | autograd | 10.000 | 2.500 | n/a* |  |" in table and "no speedup is claimed" in table
    assert "1 threads" in table and "load average before: " in table
    printed = capsys.readouterr().out
    assert "[1] T=10 B=2: backward autograd 10.000 ms, bppsa 2.500 ms\n" in printed
    assert (
        "[2] T=10 B=16: backward autograd 10.000 ms, bppsa 2.500 ms (BPPSA fell back to autograd)" in printed
    )
    plots = [out / "bench-gru-vs-T.png", out / "bench-gru-vs-invB.png"]
    assert f"written: {out / 'bench-gru.csv'}, {out / 'bench-gru.md'}, {plots[0]}, {plots[1]}" in printed
    for plot in plots:
        assert plot.read_bytes().startswith(b"\x89PNG")
    # one colour per B in both panels of the vs-T plot; the fallback point is not in the speedup panel
    latency, speed = figures[0].axes
    colours = {line.get_label(): line.get_color() for line in latency.get_lines()}
    assert (
        colours["autograd B=2"] == colours["bppsa B=2"] != colours["bppsa B=16"] == colours["autograd B=16"]
    )
    by_b = {line.get_label(): line for line in speed.get_lines() if line.get_label().startswith("B=")}
    assert (
        by_b["B=2"].get_color() == colours["bppsa B=2"] and by_b["B=16"].get_color() == colours["bppsa B=16"]
    )
    assert list(by_b["B=2"].get_xdata()) == [10, 100] and list(by_b["B=16"].get_xdata()) == [100]


def test_bench_rejects_an_unknown_name_and_an_empty_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(CLIError, match="unknown benchmark 'lstm'; choose one of rnn, gru, vgg"):
        bench("lstm")
    monkeypatch.setitem(BENCHMARKS, "vgg", (lambda **_: iter(()), {}))
    with pytest.raises(CLIError, match="measured no rows"):
        bench("vgg")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cell", "points"), [("rnn", "RNN", 4), ("gru", "GRU", 4), ("vgg", None, 2)])
def test_bench_runs_the_shipped_grids_quick_from_any_folder(
    workdir: Path, name: str, cell: str | None, points: int, capsys: pytest.CaptureFixture
) -> None:
    main(["bench", name, "--quick"])
    out = workdir / "runs" / "bench"
    with open(out / f"bench-{name}.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 * points
    grid = {(row["T"], row["B"]) for row in rows}
    assert len(grid) == points
    for point in grid:
        methods = sorted(row["method"] for row in rows if (row["T"], row["B"]) == point)
        assert methods == ["autograd", "bppsa"], point
    for row in rows:
        for key in ("backward_s", "forward_s", "step_s"):
            assert 0 < float(row[key]) < float("inf"), (key, row)  # measured: no bound on how long
        assert int(row["peak_bytes"]) >= 0 and int(row["T"]) >= 1 and int(row["B"]) >= 1
        assert row["path"] in ("scan", "autograd")
        if row["method"] == "bppsa":
            assert 0 < float(row["speedup_min"]) <= float(row["speedup_max"])
        if cell is not None:
            assert row["cell"] == cell
        else:
            assert row["T"] == "21" and row["weights"] == "pruned 97%"
    table = (out / f"bench-{name}.md").read_text()
    printed = capsys.readouterr().out
    body = [line for line in table.splitlines() if line[:3].startswith("| ") and line[2].isdigit()]
    assert len(body) == points and table in printed + "\n"
    for line in body:  # a speedup where BPPSA ran the scan, the fallback mark where it did not
        assert (
            ("| scan |" in line and line.split("|")[6].strip().endswith("x"))
            or "| autograd | " in line
            and "| n/a* |" in line
        )
    assert f"[{points}] T=" in printed and "written: runs/bench/bench-" in printed
    assert (out / f"bench-{name}-vs-invB.png").read_bytes().startswith(b"\x89PNG")
    assert (out / f"bench-{name}-vs-T.png").exists() == (cell is not None)  # VGG's T is fixed
