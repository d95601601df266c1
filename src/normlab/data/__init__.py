"""Data: the default corpus, tokenizers, token arrays and deterministic batches."""

from normlab.data.corpus import DataError, default_corpus, fetch_shakespeare
from normlab.data.dataset import TokenData, batch_at, load_data, val_batches
from normlab.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "DataError", "TokenData", "batch_at", "default_corpus", "fetch_shakespeare",
           "load_data", "load_tokenizer", "val_batches"]
