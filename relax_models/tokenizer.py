"""Tokenizers built in-process with the ``tokenizers`` library, so tests and the CPU default need no hub."""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
# every printable ASCII character except the form-feed family: enough for synthetic tasks and chat markup
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, ``<eos>`` ends a response."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in characters:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
