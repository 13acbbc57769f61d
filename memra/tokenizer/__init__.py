"""Text <-> token ids, streaming detokenization, stop strings and chat templates.

    core.py           Tokenizer: encode / decode / chat prompts for one model
    pieces.py         the exact bytes of every token; TokenizerParts (what a Tokenizer is built from)
    hf_files.py       TokenizerParts from a Hugging Face directory
    gguf_vocab.py     TokenizerParts from a GGUF file's tokenizer.* metadata
    chat_template.py  HF-compatible sandboxed jinja2 rendering
    detokenizer.py    ids -> whole characters as they arrive; TextStream adds stop strings
    stops.py          stop strings over streamed text in linear time
"""

from memra.tokenizer.core import Tokenizer
from memra.tokenizer.detokenizer import IncrementalDetokenizer, TextStream
from memra.tokenizer.pieces import (_BYTE_OF_CHAR, END_OF_TURN_TEXTS, ByteLevelPieces, DecoderPieces,
                                    SentencePiecePieces, TokenizerParts)
from memra.tokenizer.stops import StopStringFilter

__all__ = ["Tokenizer", "TokenizerParts", "IncrementalDetokenizer", "TextStream", "StopStringFilter",
           "ByteLevelPieces", "SentencePiecePieces", "DecoderPieces", "END_OF_TURN_TEXTS", "_BYTE_OF_CHAR"]
