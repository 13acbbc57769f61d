"""`random:SHAPE` models (memra.load's no-download path for real shapes): a byte-level tokenizer that
covers the whole vocabulary, so a server over random weights can decode any token it samples."""

from __future__ import annotations

import pytest

import memra
from memra.errors import MemraError
from memra.random_model import SHAPES, _llama
from memra.tokenizer.synthetic import byte_level_tokenizer


def test_the_synthetic_vocabulary_spells_every_id_and_round_trips_text():
    tok = byte_level_tokenizer(70_000)
    assert tok.vocab_size == 70_000 and tok.eos_ids == ()
    text = "ROMEO: wherefore — 😀 ünïcode\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text  # one token per byte, no merges
    pieces = {tok.token_to_piece(i) for i in range(tok.vocab_size)}
    assert len(pieces) == tok.vocab_size  # every id a distinct run of 1-3 bytes
    with pytest.raises(MemraError):
        byte_level_tokenizer(100)


def test_a_random_model_loads_with_a_tokenizer_that_covers_its_vocabulary(monkeypatch):
    monkeypatch.setitem(SHAPES, "tiny-llama", lambda layers=None: _llama(layers or 2, 64, 4, 2, 128, 300))
    m = memra.load("random:tiny-llama", device="cpu", dtype="float32")
    assert m.tokenizer.vocab_size == m.cfg.vocab_size == 300 and m.source == "random:tiny-llama"
    cache = m.new_cache(64)
    tok = int(m.prime(m.tokenizer.encode("hello"), cache).argmax())
    assert isinstance(m.tokenizer.decode([tok]), str)
    with pytest.raises(MemraError, match="unknown model shape"):
        memra.load("random:no-such-shape", device="cpu")


def test_a_random_model_takes_a_layer_count_after_its_name(monkeypatch):
    """random:NAME:LAYERS: the shape with its first LAYERS layers (the 35B-A3B on an 80 GB card), its source the
    same recipe, so a worker rebuilds it (memra.pp.dist.worker_source passes it through); a bad count is refused."""
    monkeypatch.setitem(SHAPES, "tiny-llama", lambda layers=None: _llama(layers or 2, 64, 4, 2, 128, 300))
    m = memra.load("random:tiny-llama:3", device="cpu", dtype="float32", tokenizer=False)
    assert m.cfg.n_layers == 3 and m.source == "random:tiny-llama:3"
    from memra.pp.dist import worker_source

    assert worker_source(m) == "random:tiny-llama:3"
    for bad in ("0", "x", "-1"):
        with pytest.raises(MemraError, match="positive integer"):
            memra.load(f"random:tiny-llama:{bad}", device="cpu")
