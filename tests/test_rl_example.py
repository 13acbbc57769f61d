"""examples/grpo_demo.py, short: every step's trainer logprobs equal the sampled ones exactly (max |difference| 0.0
over every generated token) and the reward rises. The full run: `python examples/grpo_demo.py` (docs/RL.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from memra import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import grpo_demo  # noqa: E402


def test_the_grpo_loop_is_on_policy_to_the_bit_and_learns():
    before = counters.snapshot()
    lines: list[str] = []
    history = grpo_demo.run(steps=4, group=4, tokens=8, lr=3e-3, prompts=grpo_demo.PROMPTS[:2], out=lines.append)
    assert [row["mismatch"] for row in history] == [0.0] * 4, "\n".join(lines)
    rewards = [row["reward"] for row in history]
    assert min(rewards[2:]) > max(rewards[:2]) + 0.05, rewards  # the reward rises
    moved = counters.delta(before)
    assert moved["weight_updates"] == 4 and moved["train_forwards"] == 4
    assert all("max |trainer - sampler| logprob 0.0 " in line for line in lines)
