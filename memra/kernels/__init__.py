"""The op table. Every model op is called through `ops`, chosen once, so that which implementation
runs is a single, visible decision (exactness depends on it). Today every device runs the pure-torch
reference; fast kernels register here behind a self-test against it."""

from memra.kernels import reference as ops

__all__ = ["ops"]
