"""Kernels: `reference` (pure torch, the meaning of every op), `triton/` (batch-invariant GPU twins, one
module per family), `quant` (GGUF-packed weights and their twin), `cuts` (absolute-position cuts) and
`table`, the one table the model calls, which picks between them once at load; `exact` self-tests it."""
