"""Hugging Face folders as bpt runs (bpt-import-hf: GPT-2 and Llama) and back (bpt-export-hf:
GPT-2-shaped runs)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
from ml_collections import ConfigDict

from bpt.config import check_config, model_config, set_family
from bpt.data.tokenizers import load_tokenizer
from bpt.models.gpt import GPT
from bpt.models.hf import SHAPE_FIELDS, hf_positions, load_hf, read_hf_config, save_hf_gpt2
from bpt.models.lm import fit_vocab
from bpt.train.checkpoint import Checkpoints
from bpt.train.loop import restore_run
from bpt.train.run_files import is_run, read_config
from bpt.train.state import create_state

TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def has_tokenizer(folder: Path) -> bool:
    """Whether a folder holds Hugging Face tokenizer files (a tokenizer.json or a vocab.json)."""
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "vocab.json"))


def copy_tokenizer(source: Path, target: Path) -> Path | None:
    """Copies the Hugging Face tokenizer files of folder source into target; None if it has none."""
    if not has_tokenizer(source):
        return None
    files = [source / name for name in TOKENIZER_FILES if (source / name).is_file()]
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy2(f, target / f.name)
    return target


def import_run(
    path: str | Path,
    workdir: str | Path,
    config: ConfigDict,
    *,
    seq_len: int = 0,
    extend: str = "interpolate",
    overwrite: bool = False,
) -> Path:
    """Writes the GPT-2 or Llama folder at path as a bpt run in workdir: config.json (config,
    with the checkpoint's model shape and data.seq_len = seq_len or the context it was made
    for), a step-0 checkpoint, and the folder's tokenizer (data.tokenizer points at it)."""
    path, workdir = Path(path), Path(workdir).absolute()
    if (workdir / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{workdir} already holds a run; choose another --workdir or pass --overwrite")
    hf = read_hf_config(path)
    seq_len = seq_len or hf_positions(hf)
    cfg, params = load_hf(path, max_seq_len=max(seq_len, hf_positions(hf)), extend=extend)

    c = ConfigDict(config.to_dict())  # unlocked copy
    c.model.update({name: getattr(cfg, name) for name in SHAPE_FIELDS})
    set_family(c, "gpt")
    c.data.seq_len = seq_len
    for name in ("q_chunk_size", "kv_chunk_size", "loss_chunk_size"):
        c.model[name] = min(c.model[name], seq_len)
    c.init.extend_positions = extend
    c.init.params_from = ""
    check_config(c)

    tokenizer_dir = workdir / "tokenizer"
    if not has_tokenizer(path) and c.data.name not in ("copy", "exorl"):  # (those read no text)
        tokens = load_tokenizer(c.data.tokenizer).vocab_size
        if tokens != cfg.vocab_size:
            raise ValueError(
                f"{path} has no tokenizer files and its model has {cfg.vocab_size} tokens, but "
                f"data.tokenizer={c.data.tokenizer!r} has {tokens}: pass --config.data.tokenizer=<the "
                "tokenizer it was trained with>"
            )
    if overwrite and workdir.exists():
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    if copy_tokenizer(path, tokenizer_dir) is not None:
        c.data.tokenizer = "tokenizer"  # the run's own copy: read relative to the run's folder
    else:
        print(f"note: {path} has no tokenizer files; the run keeps data.tokenizer={c.data.tokenizer!r}")

    model = GPT(model_config(c.model, vocab_size=cfg.vocab_size, seq_len=seq_len))
    state = create_state(c, model, jax.random.PRNGKey(c.seed))
    params = fit_vocab(params, model.config.padded_vocab)  # the run's model.vocab_multiple
    loaded = jax.tree.map(
        lambda x, like: jax.device_put(x.astype(like.dtype), like.sharding), params, state.params
    )
    state = state.replace(params=loaded)
    meta = {
        "config": json.loads(c.to_json_best_effort()),
        "seed": c.seed,
        "data_step": 0,
        "imported_from": str(path),
    }
    with Checkpoints(workdir / "checkpoints", async_save=False) as checkpoints:
        checkpoints.save(state, meta)
    (workdir / "config.json").write_text(c.to_json_best_effort(indent=2))
    return workdir


def check_export_target(workdir: Path, out: Path, *, overwrite: bool) -> None:
    """Raises FileExistsError unless out may be written: never a bpt run (a Hugging Face
    config.json would replace the run's own), and an existing folder only with overwrite."""
    if out.resolve() == Path(workdir).resolve() or is_run(out):
        raise FileExistsError(
            f"{out} holds a bpt run; bpt-export-hf never writes over one: choose another --out"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} already exists; choose another --out or pass --overwrite")


def export_run(workdir: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """The latest checkpoint of a GPT-2-shaped run as a Hugging Face GPT-2 folder at out
    (an existing folder only with overwrite, and never a bpt run)."""
    out = Path(out)
    check_export_target(Path(workdir), out, overwrite=overwrite)
    family = (read_config(Path(workdir)) or {}).get("model", {}).get("family", "gpt")
    if family != "gpt":
        raise ValueError(
            f"bpt-export-hf writes GPT-2 folders, from runs of model.family='gpt'; {workdir} is a "
            f"model.family={family!r} run"
        )
    config, dataset, model, state = restore_run(workdir)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), state.params)
    tokenizer = getattr(dataset, "tokenizer", None)
    out = save_hf_gpt2(model.config, params, out, eot_id=getattr(tokenizer, "eot_id", None))
    # The tokenizer the data was made with (prepared data names its own in its manifest).
    source = Path(getattr(tokenizer, "spec", config.data.tokenizer))
    if source.is_file():
        source = source.parent
    if source.is_dir():
        copy_tokenizer(source, Path(out))
    return Path(out)
