"""The benchmark grids behind ``lightning-bppsa bench`` (``benchmarks/rnn.py`` and ``vgg.py`` write them up).

- :mod:`lightning_bppsa.bench.measure`: median time (``torch.utils.benchmark``), peak resident memory,
  a one-line description of the machine; the thread count that runs a step fastest.
- :mod:`lightning_bppsa.bench.trial`: a training step that leaves no trace, and ``compare``'s warm-up step.
- :mod:`lightning_bppsa.bench.rnn`: RNN / GRU / LSTM, BPPSA vs torch autograd (paper Tables 4-6).
- :mod:`lightning_bppsa.bench.vgg`: VGG-11's convolutional chain, ``SparseChain`` vs autograd (Sec. 5.3).

Each grid module defines ``bench_rows(*, quick=False, **options)``; the contract is documented at
:data:`lightning_bppsa.cli.bench.BENCHMARKS`. Importing any of them runs nothing.
"""

from lightning_bppsa.bench.measure import machine_description, median_seconds, peak_memory_bytes

__all__ = ["machine_description", "median_seconds", "peak_memory_bytes"]
