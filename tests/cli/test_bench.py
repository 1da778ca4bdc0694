"""``lightning-bppsa bench``: a grid from ``lightning_bppsa.bench`` -> CSV, markdown and plots."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_bppsa.cli import main
from lightning_bppsa.cli.bench import BENCHMARKS, bench
from lightning_bppsa.cli.config import CLIError


def _fake_rows(*, quick: bool = False, cell: str = "rnn") -> Iterator[dict]:
    for T in (10, 100):
        for B in (2, 16):
            yield {"method": "autograd", "T": T, "B": B, "backward_s": 1e-3 * T, "cell": cell}
            yield {"method": "bppsa", "T": T, "B": B, "backward_s": 1e-3 * T / 4, "cell": cell}


def test_bench_writes_csv_markdown_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BENCHMARKS, "gru", (_fake_rows, {"cell": "gru"}))
    out = bench("gru", quick=True, out=str(tmp_path / "results"))
    rows = (out / "bench-gru.csv").read_text().splitlines()
    assert rows[0] == "method,T,B,backward_s,cell" and len(rows) == 9 and rows[1].endswith(",gru")
    assert "| 4.00x |" in (out / "bench-gru.md").read_text()
    for plot in ("bench-gru-vs-T.png", "bench-gru-vs-invB.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")


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
            assert 0 < float(row[key]) < 60, (key, row)
        assert int(row["peak_bytes"]) >= 0 and int(row["T"]) >= 1 and int(row["B"]) >= 1
        if cell is not None:
            assert row["cell"] == cell and row["path"] in ("scan", "autograd")
        else:
            assert row["T"] == "21" and row["weights"] == "pruned 97%"
    table = (out / f"bench-{name}.md").read_text()
    assert table.count("x |") == points and table in capsys.readouterr().out + "\n"
    assert (out / f"bench-{name}-vs-invB.png").read_bytes().startswith(b"\x89PNG")
    assert (out / f"bench-{name}-vs-T.png").exists() == (cell is not None)  # VGG's T is fixed
