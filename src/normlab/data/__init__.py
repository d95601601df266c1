"""Data: the default corpus, tokenizers, token arrays and deterministic batches."""

from normlab._lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        "DataError": "normlab.data.corpus",
        "default_corpus": "normlab.data.corpus",
        "fetch_shakespeare": "normlab.data.corpus",
        "TokenData": "normlab.data.dataset",
        "batch_at": "normlab.data.dataset",
        "load_data": "normlab.data.dataset",
        "val_batches": "normlab.data.dataset",
        "ByteTokenizer": "normlab.data.tokenizer",
        "load_tokenizer": "normlab.data.tokenizer",
    },
    globals(),
)

__all__ = [
    "ByteTokenizer",
    "DataError",
    "TokenData",
    "batch_at",
    "default_corpus",
    "fetch_shakespeare",
    "load_data",
    "load_tokenizer",
    "val_batches",
]
