"""Prepared token files: a corpus tokenized once into flat binary shards plus a manifest.

A prepared dataset is a folder:

    manifest.json         tokenizer, vocab size, end-of-text id, dtype, and per split its
                          documents, tokens, largest token id and shards (file, tokens, sha256)
    tokenizer.json        the tokenizer, when it is a `tokenizers` one (the folder is then
                          self-contained: sampling decodes with it)
    train-00000.bin ...   uint16 (vocabularies up to 65536) or uint32 tokens: every document
    val-00000.bin ...     followed by the end-of-text token; shards end at document boundaries

Training memory-maps the shards: no framework sits in the data hot loop. Everything is
written into a temporary folder that is renamed into place at the end, so an interrupted
preparation never leaves a folder that looks complete.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from bpt.data.sources import Corpus, Documents
from bpt.data.tokenizers import HFTokenizer, Tokenizer, load_tokenizer

FORMAT = "bpt-tokens"
VERSION = 1
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 100_000_000


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def file_sha256(path: Path, *, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def num_cpus() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Tokenization workers: each process loads the tokenizer once, then encodes batches.
_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = load_tokenizer(spec)


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    return [_worker_tokenizer.encode(t) for t in texts]


def encode_documents(
    docs: Documents, tokenizer: Tokenizer, *, num_workers: int, batch_docs: int = 64, desc: str = ""
) -> Iterator[np.ndarray]:
    """The token arrays of docs, in order, encoded by num_workers processes (<= 1: this one)."""
    num_workers = min(num_workers, -(-len(docs) // batch_docs))  # no idle processes
    bar = tqdm(total=len(docs), desc=desc or "tokenize", unit="doc", dynamic_ncols=True, leave=False)
    try:
        if num_workers <= 1:
            for batch in docs.batches(batch_docs):
                for text in batch:
                    yield tokenizer.encode(text)
                bar.update(len(batch))
            return
        # spawn, not fork: the caller may hold JAX's threads, which fork would copy half-alive.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer.spec,)) as pool:
            for encoded in pool.imap(_encode_batch, docs.batches(batch_docs), chunksize=4):
                yield from encoded
                bar.update(len(encoded))
    finally:
        bar.close()


class _ShardWriter:
    """Appends documents (each followed by end-of-text) to shards of about shard_tokens."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, eot_id: int, shard_tokens: int):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.eot = np.array([eot_id], dtype)
        self.shards: list[dict] = []
        self.max_id = eot_id
        self._file = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.folder / name, "wb")
        self._hash = hashlib.sha256()
        self.shards.append({"file": name, "tokens": 0, "documents": 0})

    def _close(self) -> None:
        self._file.close()
        self.shards[-1]["sha256"] = self._hash.hexdigest()
        self._file = None

    def add(self, tokens: np.ndarray) -> None:
        if not len(tokens):
            return
        if self._file is None:
            self._open()
        self.max_id = max(self.max_id, int(tokens.max()))
        for part in (tokens.astype(self.dtype), self.eot):
            data = part.tobytes()
            self._file.write(data)
            self._hash.update(data)
        shard = self.shards[-1]
        shard["tokens"] += len(tokens) + 1
        shard["documents"] += 1
        if shard["tokens"] >= self.shard_tokens:
            self._close()

    def finish(self) -> dict:
        if self._file is not None:
            self._close()
        return {
            "documents": sum(s["documents"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "max_token_id": self.max_id,
            "shards": self.shards,
        }


def prepare(
    corpus: Corpus,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    num_workers: int = 0,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
) -> dict:
    """Tokenizes corpus into the prepared-dataset folder `out`; returns its manifest.

    num_workers: tokenization processes (0: one per CPU core).
    """
    out = Path(out).expanduser()
    if (out / MANIFEST).exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a prepared dataset (pass overwrite=True / --overwrite)")
    if out.exists() and not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder or pass --overwrite")
    num_workers = num_workers or num_cpus()
    dtype = token_dtype(tokenizer.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
    try:
        tokenizer_spec, tokenizer_hash = tokenizer.spec, None
        if isinstance(tokenizer, HFTokenizer) and tokenizer.save(tmp / "tokenizer.json"):
            tokenizer_spec, tokenizer_hash = "tokenizer.json", file_sha256(tmp / "tokenizer.json")
        splits = {}
        for split, docs in corpus.splits().items():
            writer = _ShardWriter(tmp, split, dtype, tokenizer.eot_id, shard_tokens)
            for tokens in encode_documents(docs, tokenizer, num_workers=num_workers, desc=split):
                writer.add(tokens)
            splits[split] = writer.finish()
            if not splits[split]["tokens"]:
                raise ValueError(
                    f"the {split} split of {corpus.description['name']} holds no tokens; "
                    "give more text or a larger data.val_fraction"
                )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": corpus.description,
            "tokenizer": tokenizer_spec,
            "tokenizer_sha256": tokenizer_hash,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
            "dtype": dtype.name,
            "splits": splits,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


@dataclasses.dataclass
class PreparedData:
    """A prepared dataset, opened: memory-mapped shards per split, and its tokenizer."""

    path: Path
    manifest: dict
    splits: dict[str, list[np.ndarray]]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def eot_id(self) -> int:
        return self.manifest["eot_id"]

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.manifest["tokenizer"], base_dir=self.path)


def load_prepared(path: str | Path, *, verify_checksums: bool = False) -> PreparedData:
    """Opens a prepared dataset; checks every shard's size, and its sha256 when asked."""
    path = Path(path).expanduser()
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{manifest_path} not found: data.path must be a folder written by bpt-prepare-data"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{manifest_path} is not a {FORMAT} v{VERSION} manifest "
            f"(format={manifest.get('format')!r}, version={manifest.get('version')!r})"
        )
    dtype = np.dtype(manifest["dtype"])
    splits = {}
    for split, info in manifest["splits"].items():
        arrays = []
        for shard in info["shards"]:
            file = path / shard["file"]
            if not file.is_file():
                raise FileNotFoundError(f"shard {file} of the prepared dataset is missing")
            size = file.stat().st_size
            if size != shard["tokens"] * dtype.itemsize:
                raise ValueError(
                    f"shard {file} has {size} bytes; its manifest says {shard['tokens']} {dtype.name} "
                    "tokens: the file is truncated or was changed. Prepare the data again."
                )
            if verify_checksums and file_sha256(file) != shard["sha256"]:
                raise ValueError(f"shard {file} does not match its sha256 in the manifest; prepare it again")
            arrays.append(np.memmap(file, dtype=dtype, mode="r"))
        splits[split] = arrays
    return PreparedData(path, manifest, splits)
