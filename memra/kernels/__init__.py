"""Kernels: `reference` (pure torch, the meaning of every op), `triton_ops` (batch-invariant GPU
twins) and `ops`, the one table the model calls, which picks between them per call."""
