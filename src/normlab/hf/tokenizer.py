"""normlab tokenizers as transformers tokenizers, saved beside exported models.

- bytes: a byte-level BPE with the single bytes as its vocabulary and no merges, so token id =
  byte value exactly as `ByteTokenizer` does (the GPT-2 byte-to-unicode map from transformers lets
  every byte be a vocabulary symbol); id 0 is ``<|endoftext|>`` (normlab reserves byte 0, NUL, as
  end-of-text), a special token;
- a trained BPE or a local tokenizer.json: wrapped as it is.

Either way the end-of-text token is set as bos, eos and pad (GPT-2's convention): evaluation
harnesses prefix it to a context (a document start, as in training data), ``generate()`` stops on
it, and padding uses it (real tokens are marked by the attention mask, which normlab models honour).
"""

from __future__ import annotations

from typing import Any

from normlab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def to_hf_tokenizer(tok: Tokenizer, model_max_length: int | None = None) -> Any:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    if isinstance(tok, HFTokenizer):
        raw = RawTokenizer.from_str(tok.to_json())
    elif isinstance(tok, ByteTokenizer):
        symbol = bytes_to_unicode()
        vocab = {symbol[b]: b for b in range(256) if b != tok.eos_id} | {tok.eos_token: tok.eos_id}
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        raw.add_special_tokens([AddedToken(tok.eos_token, special=True)])
    else:
        raise TypeError(f"no transformers form for tokenizer {type(tok).__name__}")
    extra = {"model_max_length": model_max_length} if model_max_length else {}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=tok.eos_token, eos_token=tok.eos_token, pad_token=tok.eos_token, **extra
    )
    if hf.eos_token_id != tok.eos_id:  # cannot happen unless the vocabulary disagrees with the tokenizer
        raise ValueError(
            f"end-of-text {tok.eos_token!r} is id {hf.eos_token_id} in transformers, {tok.eos_id} in normlab"
        )
    return hf


def special_token_ids(hf_tokenizer: Any) -> dict[str, int]:
    """bos/eos/pad ids of a transformers tokenizer, for a model config and its generation config."""
    return {
        f"{k}_token_id": getattr(hf_tokenizer, f"{k}_token_id")
        for k in ("bos", "eos", "pad")
        if getattr(hf_tokenizer, f"{k}_token_id", None) is not None
    }


def set_special_tokens(hf_model: Any, tokenizer: Any) -> None:
    """The tokenizer's bos/eos/pad ids into the model's config and generation config (transformers'
    defaults, e.g. LlamaConfig's bos 1 / eos 2, would name ordinary tokens here)."""
    ids = special_token_ids(tokenizer) if tokenizer is not None else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(hf_model.config, key, ids.get(key))
        setattr(hf_model.generation_config, key, ids.get(key))
