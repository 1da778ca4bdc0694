"""The recurrent benchmark grid."""

from __future__ import annotations

import pytest

from lightning_bppsa.bench.rnn import bench_rows


@pytest.mark.slow
def test_forced_scan_takes_the_scan_path() -> None:
    rows = list(bench_rows(cell="rnn", lengths=(12,), batches=(3,), algorithm="chunked", min_run_time=0))
    assert [row["method"] for row in rows] == ["autograd", "bppsa"]
    bppsa = rows[1]
    assert bppsa["path"] == "scan" and bppsa["algorithm"] == "chunked" and bppsa["backward_s"] > 0
    assert (bppsa["T"], bppsa["B"], bppsa["input"]) == (12, 3, 1)


def test_unknown_cell_is_named() -> None:
    with pytest.raises(ValueError, match="cell must be one of rnn, gru, lstm; got 'transformer'"):
        next(bench_rows(cell="transformer"))
