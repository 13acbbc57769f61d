"""Stop strings over streamed text, in time linear in the text.

Generated text arrives a few characters at a time. A stop string may start in one piece and end in a
later one, so the filter holds back the tail of the text that could still grow into a stop string and
releases the rest. Which tail to hold is the classic string-matching question: for every stop string,
the longest suffix of the text so far that is a prefix of it. The Knuth-Morris-Pratt automaton keeps
exactly that number per stop string and updates it in amortized O(1) per character, so a stream of n
characters costs O(n x number of stops) — never the O(n x length^2) of testing every prefix of every
stop against the end of the text, which took 17 s of a server's engine thread for sixteen
100,000-character stops.

Written by hand because the standard library has no incremental matcher (str.find restarts from the
beginning of the text on every piece) and the grammar libraries on our list do not do plain stop strings.

Semantics (OpenAI's, made independent of how the text was cut into pieces): the text stops at the first
position where any stop string is complete; what precedes that occurrence is released and the stop
string itself is not (with `include`, vLLM's include_stop_str_in_output, it is, and nothing after it). When several stop strings end at the same character, the longest one (the one
that starts first) wins. Because the automaton consumes characters one at a time, the output is the same
whether the text came as one piece or one character at a time.
"""

from __future__ import annotations


def _failure(stop: str) -> list[int]:
    """KMP's failure table: fail[k] = length of the longest proper border of stop[:k + 1]."""
    fail = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


class StopStringFilter:
    """Streams text but holds back any tail that could still grow into a stop string; on a match,
    emits the text before it and stops (the stop string itself is not printed, as in OpenAI's API)."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._fail = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: chars of it that end the text seen so far
        self.pending = ""  # held back: exactly the longest of those partial matches
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped it (vLLM's stop_reason)

    def push(self, text: str, armed: bool = True) -> str:
        """The text that can be released now (possibly empty). armed=False: a stop string completed in this
        text does not stop it (vLLM's min_tokens: none before that many tokens); the matching goes on, so
        one that completes once armed still counts from where it began."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        held = self.pending + text
        offset = len(self.pending)  # where `text` starts inside `held`
        for i, ch in enumerate(text):
            length = self._advance(ch)
            if length is not None and armed:  # a stop string of this length ends at this character
                self.stopped = True
                seen = held[: offset + i + 1]
                self.matched = next((s for s in self.stops if len(s) == length and seen.endswith(s)), None)
                self.pending = ""
                return held[: offset + i + 1 - (0 if self.include else length)]
        keep = max(self._matched)
        self.pending = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    def _advance(self, ch: str) -> int | None:
        """Feed one character to every automaton. -> the length of the longest stop string completed by
        it (which is how far back the stop begins), or None."""
        done = None
        for j, stop in enumerate(self.stops):
            k, fail = self._matched[j], self._fail[j]
            while k and stop[k] != ch:
                k = fail[k - 1]
            if stop[k] == ch:
                k += 1
            if k == len(stop):
                done = max(done or 0, k)
                k = fail[k - 1]
            self._matched[j] = k
        return done

    def flush(self) -> str:
        """At the end of the stream: whatever was held back (it never became a stop string)."""
        out, self.pending = self.pending, ""
        return out
