"""bpt-prepare-data: tokenize a corpus once into memory-mapped token shards and a manifest.

    bpt-prepare-data --out data/owt                        # OpenWebText, GPT-2 BPE (network)
    bpt-prepare-data --source docs.jsonl --out data/mine --tokenizer tok/tokenizer.json
    bpt-prepare-data --source shakespeare --out data/shk --tokenizer byte

--source is 'shakespeare', a local .txt file or folder (one document per file), local
.json/.jsonl/.parquet/.csv files (a file, folder or glob; the text is in --text_field), or a
Hugging Face Hub dataset name. Train on the result with
--config.data.name=prepared --config.data.path=<out>.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common
from bpt.cli.corpus_flags import define_corpus_flags, open_source


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        source=flags.DEFINE_string("source", "openwebtext", "The corpus (see above)."),
        out=flags.DEFINE_string("out", None, "The folder to write.", required=True),
        tokenizer=flags.DEFINE_string(
            "tokenizer", "gpt2", "byte | gpt2 | tiktoken:<encoding> | path of a tokenizer.json or folder."
        ),
        workers=flags.DEFINE_integer(
            "num_workers", 0, "Tokenization processes (0: one per CPU core).", lower_bound=0
        ),
        shard_tokens=flags.DEFINE_integer(
            "shard_tokens", 100_000_000, "Tokens per shard (about).", lower_bound=1
        ),
        overwrite=flags.DEFINE_bool("overwrite", False, "Replace an existing prepared dataset at --out."),
        corpus=define_corpus_flags(),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    from bpt.data.prepare import prepare
    from bpt.data.tokenizers import load_tokenizer

    print(f"reading {f.source.value} ...", flush=True)
    tokenizer = load_tokenizer(f.tokenizer.value)
    corpus = open_source(f.corpus, f.source.value)
    manifest = prepare(
        corpus,
        tokenizer,
        f.out.value,
        num_workers=f.workers.value,
        shard_tokens=f.shard_tokens.value,
        overwrite=f.overwrite.value,
    )
    print(f"{f.out.value}: tokenizer {tokenizer.spec}, vocab {manifest['vocab_size']}, {manifest['dtype']}")
    for split, info in manifest["splits"].items():
        print(
            f"  {split:5s} {info['documents']:>10,} documents {info['tokens']:>14,} tokens "
            f"in {len(info['shards'])} shard(s)"
        )
    val_tokens = manifest["splits"]["val"]["tokens"]
    print(f"train on it with --config.data.name=prepared --config.data.path={f.out.value}")
    if val_tokens < 65537:
        print(
            f"warning: the validation split holds only {val_tokens:,} tokens, so a run can use at most "
            f"data.seq_len={max(val_tokens - 1, 0):,}; hold out more with --val_fraction "
            f"(now {f.corpus.val_fraction.value or 'the default'})",
            file=sys.stderr,
        )


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
