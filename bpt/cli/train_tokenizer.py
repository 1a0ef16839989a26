"""bpt-train-tokenizer: train a byte-level BPE tokenizer on a corpus's training split.

    bpt-train-tokenizer --source shakespeare --vocab_size 8192 --out tokenizers/shakespeare

--source and the split flags are bpt-prepare-data's. Only the training split is read, so the
validation text stays unseen. Writes <out>/tokenizer.json (or --out itself when it ends in
.json); use it with --config.data.tokenizer=<that path>.
"""

from __future__ import annotations

import itertools

from absl import app, flags, logging

from bpt.cli.corpus_flags import open_source

_SOURCE = flags.DEFINE_string("source", "shakespeare", "The corpus (see bpt-prepare-data).")
_OUT = flags.DEFINE_string("out", None, "A folder, or a .json file path.", required=True)
_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "Tokens in the vocabulary, end-of-text included.")
_MIN_FREQ = flags.DEFINE_integer("min_frequency", 2, "Merges must occur at least this often.")
_MAX_DOCS = flags.DEFINE_integer("max_documents", 0, "Train on at most this many documents (0: all).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    from bpt.data.tokenizers import train_bpe_tokenizer

    corpus = open_source(_SOURCE.value)
    texts, count = iter(corpus.train), len(corpus.train)
    if _MAX_DOCS.value:
        texts, count = itertools.islice(texts, _MAX_DOCS.value), min(count, _MAX_DOCS.value)
    tok = train_bpe_tokenizer(texts, _VOCAB.value, _OUT.value, num_texts=count, min_frequency=_MIN_FREQ.value)
    print(f"{tok.spec}: {tok.vocab_size} tokens, end-of-text id {tok.eot_id}, trained on {count} documents")
    print(f"use it with --config.data.tokenizer={tok.spec}")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
