"""Tokenizers: bytes, GPT-2 BPE through tiktoken, and Hugging Face tokenizers by local path.

Every tokenizer has the same small interface: `spec` (a string that loads it again through
load_tokenizer), `vocab_size`, `eot_id` (the end-of-text token put between documents),
`encode(text) -> int32 array` (no special tokens added) and `decode(ids) -> str`.

    load_tokenizer("byte")               UTF-8 bytes 0..255 and end-of-text 256; needs nothing
    load_tokenizer("gpt2")               tiktoken's GPT-2 BPE (also "tiktoken:<encoding>")
    load_tokenizer("path/tokenizer.json")  a `tokenizers` file, e.g. one bpt-train-tokenizer wrote
    load_tokenizer("path/folder")        a saved Hugging Face tokenizer: tokenizer.json, or GPT-2
                                         style vocab.json + merges.txt, or (when transformers is
                                         installed) anything AutoTokenizer can load offline

train_bpe_tokenizer trains a byte-level BPE tokenizer on local text with `tokenizers`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

GPT2_VOCAB = 50257  # GPT-2's BPE, the paper's tokenizer (OpenWebText)

EOT_TEXT = "<|endoftext|>"
_EOT_CANDIDATES = (EOT_TEXT, "</s>", "<eos>", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus an end-of-text token (256) between documents."""

    spec = "byte"
    eot_id = 256
    vocab_size = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """An OpenAI BPE encoding through tiktoken ("gpt2" is GPT-2's 50257-token BPE)."""

    def __init__(self, name: str):
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError(f"tokenizer 'tiktoken:{name}' needs the tiktoken package") from e
        try:
            self._enc = tiktoken.get_encoding(name)
        except ValueError as e:  # an unknown encoding name
            raise ValueError(f"tiktoken has no encoding {name!r}: {e}") from e
        except Exception as e:  # no network and no cached files
            raise RuntimeError(
                f"could not load tiktoken's {name!r} encoding: {type(e).__name__}: {e}\n"
                "tiktoken downloads its files on first use and caches them in $TIKTOKEN_CACHE_DIR. "
                "Offline, copy a filled cache there, or use a tokenizer.json by path "
                "(bpt-train-tokenizer makes one) or data.tokenizer='byte'."
            ) from e
        self.spec = f"tiktoken:{name}"
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), np.int32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json), or a transformers tokenizer, loaded by path."""

    def __init__(self, path: str | Path):
        path = Path(path).expanduser().resolve()
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
        folder = path if path.is_dir() else path.parent
        self.spec = str(path)
        self._hf = None  # a transformers tokenizer, when tokenizers alone cannot load the path
        self._tok = None
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("loading a tokenizer by path needs the tokenizers package") from e
        if path.is_file() or (path / "tokenizer.json").is_file():
            file = path if path.is_file() else path / "tokenizer.json"
            try:
                self._tok = Tokenizer.from_file(str(file))
            except Exception as e:  # noqa: BLE001  (tokenizers raises a bare Exception)
                raise ValueError(
                    f"data.tokenizer={str(path)!r} is not a tokenizers file ({e}); give a tokenizer.json "
                    "(bpt-train-tokenizer writes one), a saved Hugging Face tokenizer folder, 'byte' or 'gpt2'"
                ) from None
        elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
            from tokenizers import ByteLevelBPETokenizer

            self._tok = ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        else:
            self._hf = _load_transformers(path)
        if self._tok is not None:
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            vocab = self._tok.get_vocab(with_added_tokens=True)
        else:
            self.vocab_size = len(self._hf)
            vocab = self._hf.get_vocab()
        self.eot_id = _find_eot(vocab, folder)
        if self.eot_id is None:
            raise ValueError(
                f"the tokenizer at {str(path)!r} has no end-of-text token: none of "
                f"{', '.join(_EOT_CANDIDATES)}, and no eos_token in tokenizer_config.json"
            )

    def digest(self) -> str:
        """A short hash of what this tokenizer maps text to (its whole tokenizers file, or
        the transformers tokenizer's vocabulary)."""
        if self._tok is not None:
            text = self._tok.to_str()
        else:
            text = json.dumps(sorted(self._hf.get_vocab().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def save(self, path: str | Path) -> bool:
        """Writes a self-contained tokenizer.json; False when this tokenizer cannot."""
        if self._tok is None:
            return False
        self._tok.save(str(path))
        return True

    def encode(self, text: str) -> np.ndarray:
        if self._tok is not None:
            return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)
        return np.asarray(self._hf.encode(text, add_special_tokens=False), np.int32)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._hf.decode(ids, skip_special_tokens=True)


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """What a tokenizer maps text to, as a short string: equal for two tokenizers that encode
    alike (a copy of a tokenizer.json and its original), different once it is retrained."""
    if not isinstance(tokenizer, HFTokenizer):
        return tokenizer.spec  # bytes, or a named tiktoken encoding: fixed
    return tokenizer.digest()


def _load_transformers(path: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise FileNotFoundError(
            f"{str(path)!r} holds no tokenizer.json and no vocab.json + merges.txt "
            "(installing transformers would let bpt try AutoTokenizer on it)"
        ) from e
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise RuntimeError(f"could not load a tokenizer from {str(path)!r} offline: {e}") from e


def _find_eot(vocab: dict[str, int], folder: Path) -> int | None:
    config = folder / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):  # an AddedToken written out
            eos = eos.get("content")
        if isinstance(eos, str) and eos in vocab:
            return vocab[eos]
    for token in _EOT_CANDIDATES:
        if token in vocab:
            return vocab[token]
    return None


Tokenizer = ByteTokenizer | TiktokenTokenizer | HFTokenizer


def load_tokenizer(spec: str, *, base_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer that `spec` names (see the module docstring).

    base_dir: where a relative path is looked up first (a prepared dataset's folder).
    """
    spec = str(spec).strip()
    if spec in ("", "byte"):
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return TiktokenTokenizer(spec.removeprefix("tiktoken:"))
    path = Path(spec).expanduser()
    if base_dir is not None and not path.is_absolute() and (Path(base_dir) / path).exists():
        return HFTokenizer(Path(base_dir) / path)
    if path.exists():
        return HFTokenizer(path)
    if spec in ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base"):
        return TiktokenTokenizer(spec)
    raise ValueError(
        f"data.tokenizer={spec!r} names no tokenizer: use 'byte', 'gpt2', 'tiktoken:<encoding>', "
        "or the path of a tokenizer.json or a saved Hugging Face tokenizer folder"
    )


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out: str | Path,
    *,
    num_texts: int | None = None,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> HFTokenizer:
    """Trains a GPT-2 style byte-level BPE on `texts`; writes tokenizer.json to `out`.

    Every byte is in the vocabulary, so any text encodes; <|endoftext|> is the only special
    token and ends each document.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 1} (every byte + end-of-text)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT_TEXT],
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tok.train_from_iterator(texts, trainer, length=num_texts)
    out = Path(out)
    if out.suffix != ".json":
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return HFTokenizer(out)
