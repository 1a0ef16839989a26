"""Orbax checkpoints of a run: parameters, optimizer state and a JSON record.

Layout: <workdir>/checkpoints/<step>/{params, opt_state, meta}. Orbax writes each save into
a temporary folder and renames it when complete, so an interrupted save leaves the previous
checkpoints as they were; its leftovers are removed when the next manager opens.

Restoring tells three failures apart:
- the checkpoint belongs to another model or optimizer (a code or config change): the meta
  record lists every array's shape, and any difference stops the run with the differing
  keys (ModelMismatch); nothing is moved;
- damage (missing, truncated or undecodable files) that a second read still meets: the
  checkpoint is skipped, said in one line, and the previous one tried; a training run renames
  the folder <step>.damaged when it saves its own first checkpoint (so that a run that fails
  before then leaves the folder as it was), and read-only users (bpt-eval, bpt-sample) only
  report it;
- any other error (permissions, a flaky file system) after a second try: the run stops
  with the error (CheckpointError); nothing is moved.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax.training.train_state import TrainState
from jax.experimental import multihost_utils

from bpt.models.hf import extend_positions as extend_positions_of
from bpt.models.lm import resize_vocab, vocab_axis

ITEMS = ("params", "opt_state", "meta")
UNFINISHED = "*.orbax-checkpoint-tmp*"  # how Orbax names a save that has not been renamed into place


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def param_shapes(tree) -> dict[str, list[int]]:
    """{array path: shape}, recorded with each checkpoint to detect a changed model or optimizer."""
    return {
        jax.tree_util.keystr(path): list(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def describe_difference(saved: dict, expected: dict, limit: int = 4) -> str:
    """What differs between two param_shapes records, in a few words."""
    parts = []
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    shapes = [f"{k} {saved[k]} vs {expected[k]}" for k in expected if k in saved and saved[k] != expected[k]]
    for label, keys in (("not in the checkpoint", missing), ("not in the model", extra), ("shape", shapes)):
        if keys:
            more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
            parts.append(f"{label}: {', '.join(keys[:limit])}{more}")
    return "; ".join(parts)


# Words of the errors Orbax and TensorStore raise for files that are missing, cut short or
# undecodable: a checkpoint that still fails with one of them on a second read is damaged.
DAMAGE_MARKERS = (
    "DATA_LOSS",
    "NOT_FOUND",
    "OUT_OF_RANGE",
    "Error reading",
    "Error decoding",
    "No such file",
    "Expecting value",
    "Unterminated string",
    "truncated",
)


def _error_text(error: BaseException) -> str:
    texts = []
    while error is not None and len(texts) < 8:
        texts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def is_damage(error: BaseException) -> bool:
    """Whether error (or an error it was raised from) says the checkpoint's files are damaged."""
    text = _error_text(error)
    return isinstance(error, FileNotFoundError) or any(marker in text for marker in DAMAGE_MARKERS)


def short_reason(error: BaseException) -> str:
    """The innermost line of an error chain that names the problem, cut to a sentence's length."""
    lines = [line.strip() for line in _error_text(error).splitlines() if line.strip()]
    line = next((line for line in reversed(lines) if any(m in line for m in DAMAGE_MARKERS)), lines[0])
    return line if len(line) <= 200 else line[:197] + "..."


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every float in tree is finite: one program and one transfer to the host (one
    program per leaf would launch dozens of collectives at once on a mesh)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def vocab_resizes(saved: dict, expected: dict, vocab_size: int | None) -> dict[str, list[int]]:
    """{path: saved shape} of the arrays that differ from expected only in the vocabulary axis
    of the embedding or LM head (and their optimizer moments), with both sizes at least
    vocab_size: a checkpoint written before the vocabulary was padded, or with another
    model.vocab_multiple (fit_vocab_arrays refuses to cut rows that are not zeros). Empty
    without vocab_size."""
    if vocab_size is None:
        return {}
    resizes = {}
    for path, shape in expected.items():
        old, axis = saved.get(path), vocab_axis(path)
        if old is None or old == shape or axis is None or len(old) != len(shape):
            continue
        others = [i for i in range(len(shape)) if i != axis]
        if all(old[i] == shape[i] for i in others) and min(old[axis], shape[axis]) >= vocab_size:
            resizes[path] = old
    return resizes


def _saved_target(like, shapes: dict[str, list[int]]):
    """The restore target of a tree shaped like `like`, except that the arrays at the paths in
    shapes are read at those (saved) shapes, replicated over like's mesh."""

    def target(path, x):
        key = jax.tree_util.keystr(path)
        if key not in shapes:
            return ocp.utils.to_shape_dtype_struct(x)
        sharding = x.sharding
        if isinstance(sharding, jax.sharding.NamedSharding):
            sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(tuple(shapes[key]), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, like)


def fit_vocab_arrays(tree, like, resizes: dict[str, list[int]], vocab_size: int):
    """tree with the arrays at the paths in resizes (vocab_resizes) padded or cut to like's
    vocabulary size and placed as like's are. Their rows past vocab_size must be zeros (a
    padding); others belong to another vocabulary, and stop the restore."""
    if not resizes:
        return tree

    def fit(path, x, like_x):
        key = jax.tree_util.keystr(path)
        if key not in resizes:
            return x
        axis = vocab_axis(key)
        beyond = x[(slice(None),) * axis + (slice(vocab_size, None),)]
        if beyond.size and bool(jnp.any(beyond != 0)):
            raise ModelMismatch(
                f"the checkpoint's {key} holds {x.shape[axis]} rows and those past the model's {vocab_size} "
                "tokens are not zeros: it was trained with another vocabulary (model.vocab_size, data.tokenizer)"
            )
        return jax.device_put(resize_vocab(x, like_x.shape[axis], axis), like_x.sharding)

    return jax.tree_util.tree_map_with_path(fit, tree, like)


# What Orbax's and TensorStore's background reads leave behind when a checkpoint's files are
# damaged: one "Exception ignored in: <coroutine ...>" block per array (hundreds of lines),
# after the failed read itself has been reported, as a damaged checkpoint, in one line.
_LEFTOVER_MARKERS = ("_read_array_index_and_device_put", "Event loop is closed", "TensorStore(")


def _quiet_leftovers(unraisable) -> None:
    text = f"{unraisable.object!r} {unraisable.exc_value!r}"
    if any(marker in text for marker in _LEFTOVER_MARKERS):
        return
    _quiet_leftovers.previous(unraisable)


class _QuietLeftoverTasks(logging.Filter):
    """The same leftovers when asyncio reports them instead ("Task exception was never
    retrieved", logged with the task and its traceback: seen on a loaded machine, where a
    read's task is collected before its loop closes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = f"{record.getMessage()} {record.exc_info[1] if record.exc_info else ''!r}"
        return not any(marker in text for marker in _LEFTOVER_MARKERS)


def quiet_failed_reads() -> None:
    """Drops, for this process, the exceptions a failed checkpoint read leaves in Orbax's
    coroutines (Python prints each as "Exception ignored in ...", or asyncio's logger as a
    task's exception never retrieved); every other one is printed as before, and
    BPT_DEBUG=1 (--debug) keeps them all."""
    if os.environ.get("BPT_DEBUG", "") not in ("", "0") or sys.unraisablehook is _quiet_leftovers:
        return
    _quiet_leftovers.previous = sys.unraisablehook
    sys.unraisablehook = _quiet_leftovers
    logging.getLogger("asyncio").addFilter(_QuietLeftoverTasks())


class ModelMismatch(ValueError):
    """A checkpoint's parameters or optimizer state do not fit the configured model."""


class _Restored(NamedTuple):
    params: object
    opt_state: object


class CheckpointError(RuntimeError):
    """A checkpoint could not be read for a reason other than damage (it is left in place)."""


class Checkpoints:
    """Saves every few steps (asynchronously), keeps the newest `keep`, restores the latest good one."""

    def __init__(
        self, directory: str | Path, *, keep: int = 3, async_save: bool = True, read_only: bool = False
    ):
        """read_only: never create, clean up or move anything (bpt-eval, bpt-sample)."""
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        self.damaged: list[tuple[int, str]] = []  # (step, reason) of the checkpoints that did not load
        self._to_move: list[int] = []  # of those, the ones the first save renames <step>.damaged
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,  # (Orbax warns when a reader sets them)
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            create=False,
            read_only=read_only,
        )
        self.manager = None
        if self.directory.is_dir():
            self._remove_unfinished()
            self._open()

    def _remove_unfinished(self):
        # Done here, before the manager opens, rather than by Orbax's own cleanup, which runs in the
        # background and may still be deleting when the first restore or listing happens.
        if jax.process_index() == 0 and not self.read_only:
            for leftover in self.directory.glob(UNFINISHED):
                shutil.rmtree(leftover)

    def _open(self):
        level = absl_logging.get_verbosity()
        if self.read_only:  # Orbax announces at WARNING that a read-only folder is read-only
            absl_logging.set_verbosity(absl_logging.ERROR)
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=self._options, item_names=ITEMS)
        finally:
            absl_logging.set_verbosity(level)

    def steps(self) -> list[int]:
        """The steps of the checkpoints on disk, less those found damaged."""
        if self.manager is None:
            return []
        damaged = {step for step, _ in self.damaged}
        return sorted(step for step in self.manager.all_steps() if step not in damaged)

    def save(self, state: TrainState, meta: dict) -> None:
        """Saves state at its step. Refuses parameters or optimizer state with NaN or inf."""
        step = int(state.step)
        if not bool(_all_finite((state.params, state.opt_state))):
            raise FloatingPointError(f"refusing to write a checkpoint with NaN or inf values at step {step}")
        meta = {
            **meta,
            "step": step,
            "param_shapes": param_shapes(state.params),
            "opt_state_shapes": param_shapes(state.opt_state),
        }
        if self.manager is None:  # the first save of a new run creates the folder
            self.directory.mkdir(parents=True, exist_ok=True)
            self._open()
        self._move_damaged()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params),
                opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def _set_aside(self, step: int, reason: str) -> None:
        self.damaged.append((step, reason))
        if not self.read_only:
            self._to_move.append(step)
        later = "" if self.read_only else f"; moved to {step}.damaged when this run saves its first checkpoint"
        print(f"warning: the checkpoint at step {step} is damaged ({reason}); skipped{later}", flush=True)

    def _move_damaged(self) -> None:
        """Before this run's first save: the damaged checkpoints become <step>.damaged, out of
        Orbax's listing (which would otherwise keep them as the newest, and delete the run's
        own saves as older)."""
        if not self._to_move:
            return
        for step in self._to_move:
            folder = self.directory / str(step)
            if jax.process_index() == 0 and folder.is_dir():
                target, n = self.directory / f"{step}.damaged", 1
                while target.exists():  # an earlier run's, set aside at the same step
                    target, n = self.directory / f"{step}.damaged.{n}", n + 1
                folder.rename(target)
        self._to_move = []
        if jax.process_count() > 1:  # every process lists the folder after the renames
            multihost_utils.sync_global_devices("bpt: damaged checkpoints moved")
        self._open()

    def _read(self, step: int, state: TrainState, vocab_size: int | None = None):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if meta is None:
            raise FileNotFoundError(f"the checkpoint at step {step} has no meta record")
        resizes = {}
        for name, tree in (("param_shapes", state.params), ("opt_state_shapes", state.opt_state)):
            saved, expected = meta.get(name), param_shapes(tree)
            resizes[name] = vocab_resizes(saved or {}, expected, vocab_size)
            if saved is not None and {**saved, **{k: expected[k] for k in resizes[name]}} != expected:
                what = "parameters" if name == "param_shapes" else "optimizer state"
                raise ModelMismatch(
                    f"the checkpoint at {self.directory / str(step)} holds {what} of another shape than "
                    f"the configured run ({describe_difference(saved, expected)}); start a new workdir, or "
                    "load only its parameters with config.init.params_from"
                )

        shapes = (resizes["param_shapes"], resizes["opt_state_shapes"])
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_saved_target(state.params, shapes[0])),
                opt_state=ocp.args.StandardRestore(_saved_target(state.opt_state, shapes[1])),
            ),
        )
        params = fit_vocab_arrays(restored.params, state.params, shapes[0], vocab_size)
        opt_state = fit_vocab_arrays(restored.opt_state, state.opt_state, shapes[1], vocab_size)
        return _Restored(params, opt_state), meta

    def restore_latest(self, state: TrainState, *, vocab_size: int | None = None) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that loads, restored into state's structure; None if none.
        vocab_size: the model's vocabulary, where a checkpoint whose embedding holds another
        padding of it may be read (vocab_resizes); None: every shape must match.

        A read that fails is tried once more (a passing I/O error heals); what still fails is
        damage (set aside, the previous checkpoint tried) or an error that stops the run.
        """
        quiet_failed_reads()
        for step in reversed(self.steps()):
            for attempt in (1, 2):
                try:
                    restored, meta = self._read(step, state, vocab_size)
                    break
                except ModelMismatch:
                    raise
                except Exception as error:  # noqa: BLE001  (Orbax and TensorStore raise many types)
                    if "tree structures do not match" in _error_text(error):
                        raise ModelMismatch(
                            f"the checkpoint at {self.directory / str(step)} holds another optimizer state "
                            "than the configured run (it was saved by another version of the optimizer "
                            "settings); start a new workdir, or load only its parameters with "
                            "config.init.params_from"
                        ) from None
                    if attempt == 1:
                        continue
                    if not is_damage(error):
                        raise CheckpointError(
                            f"cannot read the checkpoint at {self.directory / str(step)} ({short_reason(error)}); "
                            "it was left as it is"
                        ) from error
                    self._set_aside(step, short_reason(error))
                    restored = None
            if restored is None:
                continue
            step_array = jax.device_put(jnp.asarray(step, state.step.dtype), state.step.sharding)
            state = state.replace(step=step_array, params=restored.params, opt_state=restored.opt_state)
            return state, meta
        return None

    def wait(self) -> None:
        if self.manager is not None:
            self.manager.wait_until_finished()

    def close(self) -> None:
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_params(
    path: str | Path, like, *, extend_positions: str = "interpolate", vocab_size: int | None = None
):
    """Parameters of a saved run for fine-tuning, cast to the dtypes of `like`.

    path: a run's workdir, its checkpoints folder, or one <step> folder in it. A learned
    position table shorter than like's (a model fine-tuned at a longer context than it was
    trained or imported at) grows by extend_positions (bpt.models.hf.extend_positions); a
    longer one keeps its first rows (a shorter context than the checkpoint's). vocab_size:
    the model's vocabulary, where an embedding of another padding of it is fitted to like's
    (vocab_resizes).
    """
    path = Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.exists():
        raise FileNotFoundError(f"config.init.params_from={str(path)!r} does not exist")
    if (path / "params").is_dir():
        step_dir = path
    else:
        steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "params").is_dir())
        if not steps:
            raise FileNotFoundError(f"no checkpoint found under config.init.params_from={str(path)!r}")
        step_dir = path / str(steps[-1])
    saved = _saved_shapes(step_dir)
    resizes = vocab_resizes(saved, param_shapes(like), vocab_size)
    shapes = dict(resizes)
    positions = saved.get("['position_embedding']")
    resize = (
        isinstance(like, dict)
        and "position_embedding" in like
        and positions is not None
        and positions[0] != like["position_embedding"].shape[0]
    )
    if resize:
        shapes["['position_embedding']"] = positions  # read at its saved length, resized below
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            params = checkpointer.restore(step_dir / "params", _saved_target(like, shapes))
        except ValueError as error:
            raise ModelMismatch(
                f"the parameters at {step_dir} do not fit the configured model: {str(error)[:500]}"
            ) from error
    params = fit_vocab_arrays(params, like, resizes, vocab_size)
    if resize:
        table = like["position_embedding"]
        saved_table = np.asarray(jax.device_get(params["position_embedding"]))
        resized = extend_positions_of(saved_table, table.shape[0], extend_positions)  # longer: its first rows
        params = {**params, "position_embedding": jax.device_put(resized.astype(table.dtype), table.sharding)}
    return params


def _saved_shapes(step_dir: Path) -> dict[str, list[int]]:
    """{array path: shape} of a checkpoint's parameters, from its meta record ({} if none)."""
    try:
        meta = json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return {}
    return meta.get("param_shapes", {}) or {}
