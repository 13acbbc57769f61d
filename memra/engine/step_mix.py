"""What an engine's steps were: how many of each kind (decode only, prefill only, mixed), their host
wall time (launch to launch; on a GPU, in steady state, the device's time a step), the decode rows and
prompt tokens they carried. `memra bench throughput` prints it, so a run shows by itself whether its
time went to decoding wide batches, to prefill, or to narrow steps at the tail."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("decode", "prefill", "mixed")


@dataclass
class KindTotals:
    steps: int = 0
    seconds: float = 0.0
    decode_rows: int = 0  # rows that decoded a token in these steps
    prompt_tokens: int = 0  # prompt positions primed in these steps


@dataclass
class StepMix:
    kinds: dict[str, KindTotals] = field(default_factory=lambda: {k: KindTotals() for k in KINDS})

    def add(self, kind: str, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        t = self.kinds[kind]
        t.steps += 1
        t.seconds += seconds
        t.decode_rows += decode_rows
        t.prompt_tokens += prompt_tokens

    def copy(self) -> "StepMix":
        return StepMix({k: KindTotals(**vars(t)) for k, t in self.kinds.items()})

    def since(self, before: "StepMix") -> "StepMix":
        """The steps taken after `before` (a copy taken earlier)."""
        return StepMix({k: KindTotals(t.steps - b.steps, t.seconds - b.seconds, t.decode_rows - b.decode_rows,
                                      t.prompt_tokens - b.prompt_tokens)
                        for (k, t), b in zip(self.kinds.items(), before.kinds.values())})

    def lines(self) -> list[str]:
        """One line a kind that ran: steps, share of the step time, mean rows and ms a step."""
        total = sum(t.seconds for t in self.kinds.values()) or 1.0
        out = []
        for kind, t in self.kinds.items():
            if t.steps:
                out.append(f"{kind:>8} steps {t.steps:7d}  {100 * t.seconds / total:5.1f}% of step time  "
                           f"{1e3 * t.seconds / t.steps:8.2f} ms/step  {t.decode_rows / t.steps:6.1f} decode rows/step  "
                           f"{t.prompt_tokens / t.steps:7.1f} prompt tok/step")
        return out

    def to_json(self) -> dict:
        return {k: vars(t) for k, t in self.kinds.items()}
