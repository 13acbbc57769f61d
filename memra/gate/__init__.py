"""Exactness batteries. `run_battery` is the decode_step_batch battery (modes config | strict)."""

from memra.gate.battery import run_battery

__all__ = ["run_battery"]
