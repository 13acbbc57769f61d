"""Stop strings over streamed text (memra.tokenizer.stops) against a brute-force reference.

The reference looks at the whole text at once: the answer is the text before the first place where a
stop string is complete (earliest end; of those ending together, the longest). The filter sees the text
in pieces and must give the same answer however the text is cut, release everything that can no longer
become a stop string, and hold back exactly the longest tail that still can.
"""

from __future__ import annotations

import random

from memra.tokenizer import StopStringFilter, TextStream


def reference(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    best = None  # (end, -length)
    for s in stops:
        i = text.find(s)
        if i >= 0:
            best = min(best or (i + len(s), -len(s)), (i + len(s), -len(s)))
    if best is None:
        return text, False
    end, neg = best
    return text[: end + neg], True


def longest_partial(text: str, stops: tuple[str, ...]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def cuts(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(0, 4)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def test_matches_the_reference_however_the_text_is_cut():
    rng = random.Random(7)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.7 else "abc\n"
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        want, stopped = reference(text, stops)
        f = StopStringFilter(stops)
        seen, got = "", ""
        for piece in cuts(rng, text):
            got += f.push(piece)
            if f.stopped:
                break
            seen += piece
            assert got + f.pending == seen  # nothing lost, nothing invented
            assert len(f.pending) == longest_partial(seen, stops)  # holds back exactly what may still match
        if not f.stopped:
            got += f.flush()
        assert (got, f.stopped) == (want, stopped), (text, stops)


def test_overlapping_stops_end_at_the_first_completed_one():
    f = StopStringFilter(("abcd", "c"))
    assert f.push("ab") == "" and f.push("cd") == "ab" and f.stopped
    g = StopStringFilter(("cd", "bcd"))  # both end at the same character: the longer one wins
    assert g.push("abcd") == "a" and g.stopped
    h = StopStringFilter(("aab",))  # a failed partial match must fall back to the right border
    assert h.push("aaa") == "a" and h.push("b") == "" and h.stopped  # "aaab" stops after "a"


def test_nothing_is_held_without_stops_and_nothing_released_after_a_stop():
    f = StopStringFilter(())
    assert f.push("abc") == "abc" and not f.stopped
    g = StopStringFilter(("x",))
    assert g.push("axb") == "a" and g.push("more") == "" and g.flush() == ""


def test_long_stop_strings_hold_only_what_may_still_match():
    stop = "ROMEO" * 200 + "#"
    f = StopStringFilter((stop,))
    out = "".join(f.push("ROMEO ") for _ in range(2000))  # each piece breaks the partial match again
    assert out + f.pending == "ROMEO " * 2000 and len(f.pending) <= len("ROMEO ")


def test_text_stream_joins_detokenizer_and_stops(load_model):
    from memra.loading.checkpoint import open_checkpoint

    tok = open_checkpoint("demo")[2]()
    ids = tok.encode("ROMEO: what news, my lord? JULIET: none.")
    whole = tok.decode(ids, skip_special=True)
    s = TextStream(tok, ("my lord",))
    out = "".join(s.push(i) for i in ids if not s.stopped) + s.finish()
    assert out == whole[: whole.index("my lord")] and s.stopped
    plain = TextStream(tok)
    assert "".join(plain.push(i) for i in ids) + plain.finish() == whole


def test_a_disarmed_filter_lets_stops_pass_and_still_matches_across_the_arming():
    """min_tokens: a stop completed before the filter is armed is text; one that began before and completes
    after counts from where it began."""
    f = StopStringFilter(("abc",))
    assert f.push("abc", armed=False) == "abc" and not f.stopped
    f = StopStringFilter(("abc",))
    assert f.push("xab", armed=False) == "x"
    assert f.push("cd") == "" and f.stopped
    f = StopStringFilter(("abc",), include=True)
    assert f.push("xab", armed=False) + f.push("cd") == "xabc" and f.stopped
