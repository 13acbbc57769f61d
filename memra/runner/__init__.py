"""How a step runs: the range-scoped bodies (bodies.py), the executor protocol and its unsplit
implementation (executor.py), and the choice of executor made once, when a model is loaded (choose.py)."""
