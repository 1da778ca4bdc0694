"""BPPSA versions of torch.nn.RNN / GRU / LSTM (filled in by the recurrent-layers work)."""

__all__: list[str] = []
