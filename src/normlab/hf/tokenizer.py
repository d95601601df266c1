"""normlab tokenizers as transformers tokenizers, saved beside exported models.

- bytes: a byte-level BPE with the 256 single bytes as its vocabulary and no merges, so token id =
  byte value exactly as `ByteTokenizer` does (the GPT-2 byte-to-unicode map from transformers lets
  every byte be a vocabulary symbol);
- a trained BPE or a local tokenizer.json: wrapped as it is.
"""

from __future__ import annotations

from typing import Any

from normlab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def to_hf_tokenizer(tok: Tokenizer) -> Any:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if isinstance(tok, HFTokenizer):
        return PreTrainedTokenizerFast(tokenizer_object=tok._tok)
    if isinstance(tok, ByteTokenizer):
        symbol = bytes_to_unicode()
        raw = RawTokenizer(models.BPE(vocab={symbol[b]: b for b in range(256)}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=raw)
    raise TypeError(f"no transformers form for tokenizer {type(tok).__name__}")
