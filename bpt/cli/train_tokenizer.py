"""bpt-train-tokenizer: train a byte-level BPE tokenizer on a corpus's training split.

    bpt-train-tokenizer --source shakespeare --vocab_size 8192 --out tokenizers/shakespeare

--source and the split flags are bpt-prepare-data's. Only the training split is read, so the
validation text stays unseen. Writes <out>/tokenizer.json (or --out itself when it ends in
.json); use it with --config.data.tokenizer=<that path>.
"""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common
from bpt.cli.corpus_flags import define_corpus_flags, open_source


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        source=flags.DEFINE_string("source", "shakespeare", "The corpus (see bpt-prepare-data)."),
        out=flags.DEFINE_string("out", None, "A folder, or a .json file path.", required=True),
        vocab=flags.DEFINE_integer(
            "vocab_size", 8192, "Tokens in the vocabulary, end-of-text included.", lower_bound=2
        ),
        min_freq=flags.DEFINE_integer(
            "min_frequency", 2, "Merges must occur at least this often.", lower_bound=1
        ),
        max_docs=flags.DEFINE_integer(
            "max_documents", 0, "Train on at most this many documents (0: all).", lower_bound=0
        ),
        overwrite=flags.DEFINE_bool(
            "overwrite", False, "Replace a tokenizer already at --out (runs trained with it keep their own copy)."
        ),
        corpus=define_corpus_flags(),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    from pathlib import Path

    from bpt.data.tokenizers import train_bpe_tokenizer

    out = Path(f.out.value)
    target = out if out.suffix == ".json" else out / "tokenizer.json"
    if target.exists() and not f.overwrite.value:
        raise FileExistsError(f"{target} already exists; choose another --out or pass --overwrite")
    print(f"reading {f.source.value} ...", flush=True)
    corpus = open_source(f.corpus, f.source.value)
    texts, count = iter(corpus.train), len(corpus.train)
    if f.max_docs.value:
        texts, count = itertools.islice(texts, f.max_docs.value), min(count, f.max_docs.value)
    tok = train_bpe_tokenizer(
        texts, f.vocab.value, f.out.value, num_texts=count, min_frequency=f.min_freq.value
    )
    print(f"{tok.spec}: {tok.vocab_size} tokens, end-of-text id {tok.eot_id}, trained on {count} documents")
    print(f"use it with --config.data.tokenizer={tok.spec}")
    if tok.vocab_size < f.vocab.value:
        print(
            f"warning: the corpus gave only {tok.vocab_size} of the --vocab_size={f.vocab.value} tokens "
            f"asked for: its training split is too small for more merges that occur at least "
            f"--min_frequency={f.min_freq.value} times; use more text or a smaller --vocab_size",
            file=sys.stderr,
        )


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
