"""The compiled cell loop's blocks of batch rows (kernels/cell_loop.h): its products with the weights run on several
rows at once (4 with AVX-512, else 2), the rows left over one at a time, in vectors (weights zero-padded where a
row is not whole vectors). Every batch size around a block (1, one short of it, one over, several blocks and a
rest), split over one and two threads, with widths that need padding or not and products split into several
column tiles, equals autograd through the cell's Python loop in float64, for a loss on every step's output and on
the final state."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning_bppsa.kernels import _native
from torch import nn

from lightning_bppsa.nn import Recurrence, cell_kernel

F64 = torch.float64

pytestmark = pytest.mark.skipif(
    not _native.build_expected(), reason="no C compiler: the loop is not compiled"
)

#: tests/nn/test_cell_corpus.py: its cells and ``_loop`` (the cell in a Python loop)
_spec = importlib.util.spec_from_file_location(
    "_corpus_blocks", Path(__file__).with_name("test_cell_corpus.py")
)
CORPUS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(CORPUS)


class LateRead(nn.Module):
    """A state ``(c, h)`` whose linear map reads only ``h``, the second state: the products skip the first
    state's columns (they start past column 0)."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.state_size = (hidden, hidden)
        self.ih, self.hh = nn.Linear(inputs, 2 * hidden), nn.Linear(hidden, 2 * hidden, bias=False)

    def forward(self, x, state):
        c, h = state
        f, g = (self.ih(x) + self.hh(h)).chunk(2, -1)
        c = torch.sigmoid(f) * c + torch.tanh(g)
        return c, torch.tanh(c) * torch.sigmoid(g)


#: (cell, hidden): padded widths (5 of a pieces' or state's columns: the loop's zero-padded weight copies), the
#: products of one state of two (HandLSTM reads h, its first; LateRead its second; at 8 the weights are read in
#: place, rows wider than the columns read), none at all (IndRNN), blocks of a common divisor (CoprimeWidths) and
#: products wider than one tile of columns (WideFirst at 40: 120 of them)
CASES = [
    (CORPUS.WideFirst, 5),
    (CORPUS.HandLSTM, 5),
    (LateRead, 5),
    (CORPUS.HandLSTM, 8),
    (LateRead, 8),
    (CORPUS.IndRNN, 5),
    (CORPUS.CoprimeWidths, 5),
    (CORPUS.WideFirst, 40),
]


def _losses(out: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """A loss on every step's output (weighted per coordinate) and on the final state."""
    weights = torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype)
    return (out.pow(2) * weights).sum() + final.sin().sum()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("cell_type, hidden", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_blocks_of_rows_equal_autograd_through_the_loop_in_float64(cell_type, hidden, batch, threads):
    torch.manual_seed(batch)
    cell = cell_type(3, hidden).to(F64)
    if isinstance(cell.state_size, tuple):  # every state tensor's gradient path: the loss reads all of them
        cell.output_fn = lambda state: torch.cat(state, -1)
    x = torch.randn(6, batch, 3, dtype=F64, requires_grad=True)
    leaves = [x, *cell.parameters()]
    module = Recurrence(cell, algorithm="linear")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, final = module(x)
        final = torch.cat(final, -1) if isinstance(final, tuple) else final
        ours = [out.detach(), *torch.autograd.grad(_losses(out, final), leaves)]
    finally:
        torch.set_num_threads(saved)
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    steps = CORPUS._loop(cell, x)
    theirs = [steps.detach(), *torch.autograd.grad(_losses(steps, steps[-1]), leaves)]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("function", ["bppsa_cell_forward", "bppsa_cell_backward"])
def test_a_loop_without_memory_for_its_scratch_raises_memory_error(monkeypatch, function):
    """The loops return -1 where they cannot allocate their scratch (a thread's rows, padded weights): the call
    raises, it does not go on with what they left unwritten."""
    torch.manual_seed(0)
    cell = CORPUS.WideFirst(3, 5).to(F64)
    x = torch.randn(6, 3, 3, dtype=F64, requires_grad=True)
    module = Recurrence(cell, algorithm="linear")
    module(x)[0].sum().backward()  # traced, checked and built
    assert module.last_stats["cell_kernel"], module.last_stats["cell_kernel_reason"]
    for library in cell_kernel._LIBRARIES.values():
        monkeypatch.setattr(library, function, lambda *args: -1)
    with pytest.raises(MemoryError, match="scratch"):
        module(x)[0].sum().backward()
