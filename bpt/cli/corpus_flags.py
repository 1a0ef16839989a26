"""The flags that say how to read and split a corpus, shared by bpt-prepare-data and
bpt-train-tokenizer (so a tokenizer is trained on exactly the split the data is prepared with)."""

from __future__ import annotations

from types import SimpleNamespace

from absl import flags


def define_corpus_flags() -> SimpleNamespace:
    return SimpleNamespace(
        text_field=flags.DEFINE_string("text_field", "text", "Datasets sources: the text column."),
        subset=flags.DEFINE_string("subset", "", "Hub datasets: the configuration name."),
        val_split=flags.DEFINE_string("val_split", "", "Datasets sources: validate on this split."),
        val_fraction=flags.DEFINE_float(
            "val_fraction",
            None,
            "Held out for validation, in (0, 1) (default: 0.0005 of documents, 0.05 of each text).",
            lower_bound=0.0,
            upper_bound=1.0,
        ),
        val_documents=flags.DEFINE_integer(
            "val_documents",
            0,
            "Local text: hold out this many whole documents (picked with --split_seed) instead of "
            "the tail of each.",
            lower_bound=0,
        ),
        split_seed=flags.DEFINE_integer(
            "split_seed", 2357, "The seed of the split (train_test_split, or the held-out documents)."
        ),
        cache_dir=flags.DEFINE_string("cache_dir", "", "Where the Shakespeare corpus is cached."),
    )


def open_source(f: SimpleNamespace, source: str):
    """The corpus --source names (see bpt-prepare-data), read and split as the flags say."""
    from bpt.data.sources import detect_kind, open_corpus

    kind = detect_kind(source)
    return open_corpus(
        kind,
        "" if kind == "shakespeare" else source,
        text_field=f.text_field.value,
        val_fraction=f.val_fraction.value,
        val_documents=f.val_documents.value,
        split_seed=f.split_seed.value,
        val_split=f.val_split.value,
        hf_subset=f.subset.value,
        cache_dir=f.cache_dir.value,
    )
