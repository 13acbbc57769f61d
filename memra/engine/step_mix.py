"""What an engine's steps were: how many of each kind (decode only, prefill only, mixed), their host
wall time (launch to launch; on a GPU, in steady state, the device's time a step), the decode rows and
prompt tokens they carried, and what sat between them (memra.engine.step_clock): the host's gap from
one step's last launch to the next step's first, and on CUDA the device's idle time before each step
and its busy time within it. `memra bench throughput` prints it, so a run shows by itself whether its
time went to decoding wide batches, to prefill, to narrow steps at the tail (the decode steps' row
histogram), or to a GPU waiting for the host (the idle share)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

KINDS = ("decode", "prefill", "mixed")
ROW_EDGES = (32, 64, 128, 256, 512)  # the decode steps' row histogram: <32, <64, ..., >=512


def row_bin(rows: int) -> str:
    """The histogram bin of a decode step of `rows` rows."""
    edge = next((e for e in ROW_EDGES if rows < e), None)
    return f"<{edge}" if edge is not None else f">={ROW_EDGES[-1]}"


ROW_BINS = tuple(f"<{e}" for e in ROW_EDGES) + (f">={ROW_EDGES[-1]}",)


@dataclass
class KindTotals:
    steps: int = 0
    seconds: float = 0.0
    decode_rows: int = 0  # rows that decoded a token in these steps
    prompt_tokens: int = 0  # prompt positions primed in these steps
    host_gap: float = 0.0  # host seconds from the previous step's last launch to this step's first
    gaps: int = 0  # steps with a host gap (not the first after the engine idled)
    device_idle: float = 0.0  # CUDA: seconds the stream sat empty before this step's first work
    device_busy: float = 0.0  # CUDA: seconds from this step's first work on the stream to its last
    device_wait: float = 0.0  # CUDA: seconds within device_busy the stream sat empty while the host landed tokens
    timed: int = 0  # steps whose device times have been read (memra.engine.step_clock)


@dataclass
class StepMix:
    kinds: dict[str, KindTotals] = field(default_factory=lambda: {k: KindTotals() for k in KINDS})
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROW_BINS, 0))  # decode steps by rows

    def add(self, kind: str, decode_rows: int, prompt_tokens: int, seconds: float, host_gap: float | None = None) -> None:
        t = self.kinds[kind]
        t.steps += 1
        t.seconds += seconds
        t.decode_rows += decode_rows
        t.prompt_tokens += prompt_tokens
        if host_gap is not None:
            t.host_gap += host_gap
            t.gaps += 1
        if kind == "decode":
            self.rows[row_bin(decode_rows)] += 1

    def add_device(self, kind: str, idle: float | None, busy: float, waited: float = 0.0) -> None:
        """A step's device times, read from its CUDA events (idle None: the first after the engine idled)."""
        t = self.kinds[kind]
        t.device_idle += idle or 0.0
        t.device_busy += busy
        t.device_wait += waited
        t.timed += 1

    def copy(self) -> "StepMix":
        return StepMix({k: KindTotals(**vars(t)) for k, t in self.kinds.items()}, dict(self.rows))

    def since(self, before: "StepMix") -> "StepMix":
        """The steps taken after `before` (a copy taken earlier)."""
        names = [f.name for f in fields(KindTotals)]
        return StepMix({k: KindTotals(*(getattr(t, n) - getattr(b, n) for n in names))
                        for (k, t), b in zip(self.kinds.items(), before.kinds.values())},
                       {k: n - before.rows[k] for k, n in self.rows.items()})

    @property
    def idle_share(self) -> float | None:
        """The device's idle time between steps over its whole time (idle + busy); None without CUDA times."""
        idle = sum(t.device_idle for t in self.kinds.values())
        busy = sum(t.device_busy for t in self.kinds.values())
        return idle / (idle + busy) if busy else None

    @property
    def wait_share(self) -> float | None:
        """The device's idle time within steps (the forward done, the sampling not yet launched) over its whole time."""
        idle = sum(t.device_idle for t in self.kinds.values())
        busy = sum(t.device_busy for t in self.kinds.values())
        return sum(t.device_wait for t in self.kinds.values()) / (idle + busy) if busy else None

    def lines(self) -> list[str]:
        """One line a kind that ran (steps, share of the step time, mean ms, rows and prompt tokens a step, the
        mean host gap before it, and on CUDA the device's mean idle time before it), the decode steps' row
        histogram, and the idle share."""
        total = sum(t.seconds for t in self.kinds.values()) or 1.0
        out = []
        for kind, t in self.kinds.items():
            if t.steps:
                gap = f"  host gap {1e3 * t.host_gap / t.gaps:6.2f} ms" if t.gaps else ""
                idle = f"  GPU idle before {1e3 * t.device_idle / t.timed:6.2f} ms" if t.timed else ""
                out.append(f"{kind:>8} steps {t.steps:7d}  {100 * t.seconds / total:5.1f}% of step time  "
                           f"{1e3 * t.seconds / t.steps:8.2f} ms/step  {t.decode_rows / t.steps:6.1f} decode rows/step  "
                           f"{t.prompt_tokens / t.steps:7.1f} prompt tok/step{gap}{idle}")
        if any(self.rows.values()):
            out.append("  decode steps by rows: " + "  ".join(f"{k} {n}" for k, n in self.rows.items()))
        share = self.idle_share
        if share is not None:
            out.append(f"  GPU idle between steps: {100 * share:.1f}% of the device's step time, and within steps "
                       f"{100 * self.wait_share:.1f}% (the forward done, its sampling waiting for the landing; CUDA events)")
            # the host's ms/step above run from a step's first launch to its end on the host: what the host did
            # between two steps (scheduling) is outside them, while the device's own times hold all of it
            out.append("  device time a step (its first launch on the stream to its last, CUDA events): "
                       + "  ".join(f"{kind} {1e3 * t.device_busy / t.timed:.2f} ms" for kind, t in self.kinds.items()
                                   if t.timed)
                       + f"; {sum(t.device_busy + t.device_idle for t in self.kinds.values()):.2f} s in all")
        return out

    def to_json(self) -> dict:
        """The kinds' totals (the row histogram and the idle share are `rows` and `idle_share`)."""
        return {k: vars(t) for k, t in self.kinds.items()}
