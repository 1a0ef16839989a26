"""The flags that say how to read and split a corpus, shared by bpt-prepare-data and
bpt-train-tokenizer (so a tokenizer is trained on exactly the split the data is prepared with)."""

from __future__ import annotations

from absl import flags

_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "Datasets sources: the text column.")
_SUBSET = flags.DEFINE_string("subset", "", "Hub datasets: the configuration name.")
_VAL_SPLIT = flags.DEFINE_string("val_split", "", "Datasets sources: validate on this split.")
_VAL_FRACTION = flags.DEFINE_float(
    "val_fraction", None, "Held out for validation (default: 0.0005 of documents, 0.05 of each text)."
)
_SPLIT_SEED = flags.DEFINE_integer("split_seed", 2357, "Datasets sources: the train_test_split seed.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", "", "Where the Shakespeare corpus is cached.")


def open_source(source: str):
    """The corpus --source names (see bpt-prepare-data), read and split as the flags say."""
    from bpt.data.sources import detect_kind, open_corpus

    kind = detect_kind(source)
    return open_corpus(
        kind,
        "" if kind == "shakespeare" else source,
        text_field=_TEXT_FIELD.value,
        val_fraction=_VAL_FRACTION.value,
        split_seed=_SPLIT_SEED.value,
        val_split=_VAL_SPLIT.value,
        hf_subset=_SUBSET.value,
        cache_dir=_CACHE_DIR.value,
    )
