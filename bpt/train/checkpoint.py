"""Orbax checkpoints of a run: parameters, optimizer state and a JSON record.

Layout: <workdir>/checkpoints/<step>/{params, opt_state, meta}. Orbax writes each save into
a temporary folder and renames it when complete, so an interrupted save leaves the previous
checkpoints as they were; its leftovers are removed when the next manager opens.

Restoring tells three failures apart:
- the checkpoint belongs to another model or optimizer (a code or config change): the meta
  record lists every array's shape, and any difference stops the run with the differing
  keys (ModelMismatch); nothing is moved;
- damage (missing, truncated or undecodable files) that a second read still meets: the
  training run renames the folder <step>.damaged, says so, and tries the previous one;
  read-only users (bpt-eval, bpt-sample) only report it;
- any other error (permissions, a flaky file system) after a second try: the run stops
  with the error (CheckpointError); nothing is moved.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from flax.training.train_state import TrainState

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


class ModelMismatch(ValueError):
    """A checkpoint's parameters or optimizer state do not fit the configured model."""


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
        return [] if self.manager is None else sorted(self.manager.all_steps())

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
        if self.read_only or jax.process_index() != 0:
            print(f"warning: the checkpoint at step {step} is damaged ({reason}); skipped", flush=True)
            return
        damaged = self.directory / f"{step}.damaged"
        (self.directory / str(step)).rename(damaged)
        print(f"warning: the checkpoint at step {step} is damaged ({reason}); moved to {damaged}", flush=True)
        self._open()

    def _read(self, step: int, state: TrainState):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        if meta is None:
            raise FileNotFoundError(f"the checkpoint at step {step} has no meta record")
        for name, tree in (("param_shapes", state.params), ("opt_state_shapes", state.opt_state)):
            saved, expected = meta.get(name), param_shapes(tree)
            if saved is not None and saved != expected:
                what = "parameters" if name == "param_shapes" else "optimizer state"
                raise ModelMismatch(
                    f"the checkpoint at {self.directory / str(step)} holds {what} of another shape than "
                    f"the configured run ({describe_difference(saved, expected)}); start a new workdir, or "
                    "load only its parameters with config.init.params_from"
                )
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(state.params)),
                opt_state=ocp.args.StandardRestore(_abstract(state.opt_state)),
            ),
        )
        return restored, meta

    def restore_latest(self, state: TrainState) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that loads, restored into state's structure; None if none.

        A read that fails is tried once more (a passing I/O error heals); what still fails is
        damage (set aside, the previous checkpoint tried) or an error that stops the run.
        """
        for step in reversed(self.steps()):
            for attempt in (1, 2):
                try:
                    restored, meta = self._read(step, state)
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


def load_params(path: str | Path, like, *, extend_positions: str = "interpolate"):
    """Parameters of a saved run for fine-tuning, cast to the dtypes of `like`.

    path: a run's workdir, its checkpoints folder, or one <step> folder in it. A learned
    position table shorter than like's (a model fine-tuned at a longer context than it was
    trained or imported at) grows by extend_positions (bpt.models.hf.extend_positions); a
    longer one keeps its first rows (a shorter context than the checkpoint's).
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
    target = _abstract(like)
    positions = _saved_positions(step_dir)
    resize = (
        isinstance(like, dict)
        and "position_embedding" in like
        and positions is not None
        and positions != like["position_embedding"].shape[0]
    )
    if resize:
        table = like["position_embedding"]
        target = {
            **target,
            "position_embedding": jax.ShapeDtypeStruct(
                (positions, *table.shape[1:]), table.dtype, sharding=table.sharding
            ),
        }
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            params = checkpointer.restore(step_dir / "params", target)
        except ValueError as error:
            raise ModelMismatch(
                f"the parameters at {step_dir} do not fit the configured model: {str(error)[:500]}"
            ) from error
    if resize:
        from bpt.models.hf import extend_positions as extend

        table = like["position_embedding"]
        saved = np.asarray(jax.device_get(params["position_embedding"]))
        resized = extend(saved, table.shape[0], extend_positions)  # longer: its first rows
        params = {**params, "position_embedding": jax.device_put(resized.astype(table.dtype), table.sharding)}
    return params


def _saved_positions(step_dir: Path) -> int | None:
    """Rows of the learned position table a checkpoint holds, from its meta record."""
    try:
        meta = json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None
    shape = meta.get("param_shapes", {}).get("['position_embedding']")
    return shape[0] if shape else None
