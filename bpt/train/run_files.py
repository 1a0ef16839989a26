"""The files of a run folder beside its checkpoints, kept true to them.

    config.json             the settings the newest checkpoints were trained with
    settings_history.jsonl  one line each time a run starts or resumes with other settings:
                            the step, the date, and each setting that changed (old, new)
    metrics.jsonl           one line per logged step (bpt.train.metrics.MetricsWriter)
    tokenizer/              the run's own copy of a tokenizer read from a path (data.tokenizer,
                            or a prepared folder's): the run is evaluated and sampled with it
                            wherever the folder is moved or copied, and a run resumed with
                            another tokenizer under the same path is refused

A run that resumes (its folder holds a run already) changes none of them until its first new
checkpoint is on disk (or, with train.checkpoint_every=0, until it ends): a run refused by a
check, or one that fails before that checkpoint, leaves the folder byte for byte as it was,
and config.json never describes settings that no checkpoint was trained with. RunFiles holds
what is to be written until then (commit). A new run (an empty or new folder) has nothing to
lose: it writes them as soon as its checks have passed, so that its metrics can be followed
from the first step.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from ml_collections import ConfigDict

from bpt.data.tokenizers import load_tokenizer, vocabulary_digest

CONFIG = "config.json"
TOKENIZER = "tokenizer"
HISTORY = "settings_history.jsonl"
METRICS = "metrics.jsonl"


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"section.name": value} of a nested settings dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def setting_changes(saved: dict, config: ConfigDict) -> dict[str, tuple]:
    """{key: (old, new)} of the settings config changes from a saved config.json (settings
    the saved file lacks, from before they existed, count as their default: not a change)."""
    old, new = flatten(saved), flatten(json.loads(config.to_json_best_effort()))
    return {key: (old[key], value) for key, value in new.items() if key in old and old[key] != value}


def describe_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())


def read_config(workdir: Path) -> dict | None:
    path = Path(workdir) / CONFIG
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} is not valid JSON ({error}); it was left as it is") from None


def latest_metrics(path: Path, last_step: int, *, write: bool = True) -> tuple[dict, int]:
    """(the last row of metrics.jsonl at or before last_step, rows past it): with write, the
    rows past last_step (logged after the checkpoint the run resumes from, or by a run that
    restarts) are removed, so the file never holds two rows for one step."""
    if not path.is_file():
        return {}, 0
    kept, dropped, last = [], 0, {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            dropped += 1
            continue
        if record.get("step", 0) <= last_step and not (record.get("stopped") and record["step"] == last_step):
            kept.append(line)
            last = record
        else:
            dropped += 1
    if dropped and write:
        temporary = path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        temporary.replace(path)
    return last, dropped


# Files that make a folder something other than a run: prepared data (bpt-prepare-data), a
# Hugging Face model or tokenizer, ExoRL episodes.
FOREIGN = {
    "manifest.json": "prepared data",
    "model.safetensors": "a Hugging Face model",
    "model.safetensors.index.json": "a Hugging Face model",
    "tokenizer.json": "a tokenizer",
    "vocab.json": "a tokenizer",
}


def is_run(path: Path) -> bool:
    """Whether a folder holds a bpt run (its checkpoints, or a bpt config.json)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return True
    try:
        saved = read_config(path)
    except ValueError:  # a config.json that is not JSON: not a run's
        return False
    return isinstance(saved, dict) and {"model", "data", "train"} <= saved.keys()


def check_workdir(workdir: Path) -> None:
    """Raises FileExistsError for a --workdir that is a file, or a folder of data, a model or
    a tokenizer rather than a run: a run would mix its files into it."""
    workdir = Path(workdir)
    if not workdir.exists():
        return
    if not workdir.is_dir():
        raise FileExistsError(f"--workdir {workdir} is a file; give a folder for the run")
    names = {p.name for p in workdir.iterdir()}
    foreign = sorted(FOREIGN[n] for n in names & FOREIGN.keys())
    if CONFIG in names and not is_run(workdir):
        foreign.append("a config.json that is not a bpt run's")
    if any(n.endswith(".npz") for n in names) and "checkpoints" not in names:
        foreign.append("ExoRL episodes")
    if foreign:
        raise FileExistsError(
            f"--workdir {workdir} holds {foreign[0]}, not a bpt run; give a new or empty folder for the run"
        )


def own_tokenizer_path(workdir: Path) -> Path | None:
    """The folder of the run's copy of its tokenizer; None if it keeps none (bytes, tiktoken,
    no data)."""
    folder = Path(workdir) / TOKENIZER
    return folder if (folder / "tokenizer.json").is_file() else None


def own_tokenizer(workdir: Path):
    """The run's copy of its tokenizer, loaded (None if it keeps none)."""
    folder = own_tokenizer_path(workdir)
    return None if folder is None else load_tokenizer(str(folder))


def check_tokenizer(workdir: Path, tokenizer, setting: str) -> None:
    """Raises ValueError if the run keeps a tokenizer and `tokenizer` encodes otherwise."""
    own = own_tokenizer(workdir)
    if own is None or tokenizer is None or vocabulary_digest(own) == vocabulary_digest(tokenizer):
        return
    raise ValueError(
        f"{setting} is not the tokenizer this run was trained with (its vocabulary differs from the "
        f"run's copy, {Path(workdir) / TOKENIZER}); set data.tokenizer={Path(workdir) / TOKENIZER} to go on "
        "with the run's own, or start a new workdir"
    )


class RunFiles:
    """What a starting (or resuming) run will write to its folder once it has a checkpoint.

    saved: the folder's config.json as it was (None for a new run); start: the step the run
    starts from. commit() writes config.json (atomically), a settings_history.jsonl line and
    the metrics.jsonl cut back to start; it is called once, after the first new checkpoint.
    """

    def __init__(
        self,
        workdir: str | Path,
        config: ConfigDict,
        start: int,
        *,
        writer: bool = True,
        tokenizer=None,
        resumed: bool = False,
    ):
        """tokenizer: the run's data's, kept as its own copy (tokenizer/) at the first commit
        (a resumed run keeps the copy it has)."""
        self.workdir = Path(workdir)
        self.tokenizer, self.resumed = tokenizer, resumed
        self.config, self.start, self.writer = config, start, writer
        self.saved = read_config(self.workdir)
        self.changes = setting_changes(self.saved, config) if self.saved is not None else {}
        self.committed = False
        # Nothing of a run there yet: no settings, metrics or checkpoints to keep as they are.
        self.new = self.saved is None and not any(
            (self.workdir / name).exists() for name in (METRICS, "checkpoints", HISTORY)
        )

    def commit(self) -> int:
        """Writes config.json and the history line, and cuts metrics.jsonl back to the
        start; returns the metrics rows removed. Only the writing process writes."""
        if self.committed:
            return 0
        self.committed = True
        if not self.writer:
            return 0
        self.workdir.mkdir(parents=True, exist_ok=True)
        save = getattr(self.tokenizer, "save", None)
        if save is not None and not (self.resumed and own_tokenizer_path(self.workdir)):
            folder = self.workdir / TOKENIZER
            folder.mkdir(exist_ok=True)
            save(folder / "tokenizer.json")
        temporary = self.workdir / (CONFIG + ".tmp")
        temporary.write_text(self.config.to_json_best_effort(indent=2))
        temporary.replace(self.workdir / CONFIG)
        if self.saved is None or self.changes:
            entry = {"step": self.start, "date": datetime.datetime.now().isoformat(timespec="seconds")}
            if self.saved is None:
                entry["settings"] = "config.json"  # a new run: its first settings are config.json
            else:
                entry["changed"] = {key: [old, new] for key, (old, new) in self.changes.items()}
            with open(self.workdir / HISTORY, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return latest_metrics(self.workdir / METRICS, self.start)[1]
