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

from absl import app, flags, logging

from bpt.cli.corpus_flags import open_source

_SOURCE = flags.DEFINE_string("source", "openwebtext", "The corpus (see above).")
_OUT = flags.DEFINE_string("out", None, "The folder to write.", required=True)
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", "gpt2", "byte | gpt2 | tiktoken:<encoding> | path of a tokenizer.json or folder."
)
_WORKERS = flags.DEFINE_integer("num_workers", 0, "Tokenization processes (0: one per CPU core).")
_SHARD_TOKENS = flags.DEFINE_integer("shard_tokens", 100_000_000, "Tokens per shard (about).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing prepared dataset at --out.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    from bpt.data.prepare import prepare
    from bpt.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(_TOKENIZER.value)
    corpus = open_source(_SOURCE.value)
    manifest = prepare(
        corpus,
        tokenizer,
        _OUT.value,
        num_workers=_WORKERS.value,
        shard_tokens=_SHARD_TOKENS.value,
        overwrite=_OVERWRITE.value,
    )
    print(f"{_OUT.value}: tokenizer {tokenizer.spec}, vocab {manifest['vocab_size']}, {manifest['dtype']}")
    for split, info in manifest["splits"].items():
        print(
            f"  {split:5s} {info['documents']:>10,} documents {info['tokens']:>14,} tokens "
            f"in {len(info['shards'])} shard(s)"
        )
    print(f"train on it with --config.data.name=prepared --config.data.path={_OUT.value}")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
