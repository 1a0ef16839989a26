"""Orbax checkpoints of a run: parameters, optimizer state and a JSON record.

Layout: <workdir>/checkpoints/<step>/{params, opt_state, meta}. Orbax writes each save into
a temporary folder and renames it when complete, so an interrupted save leaves the previous
checkpoints as they were; its leftovers are removed when the next manager opens. A
finalized checkpoint that fails to load is renamed to <step>.damaged, reported, and never
loaded or counted again.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax.training.train_state import TrainState

ITEMS = ("params", "opt_state", "meta")
UNFINISHED = "*.orbax-checkpoint-tmp*"  # how Orbax names a save that has not been renamed into place


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def param_shapes(params) -> dict[str, list[int]]:
    """{parameter path: shape}, recorded with each checkpoint to detect a changed model."""
    return {
        jax.tree_util.keystr(path): list(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(params)
    }


@jax.jit
def _all_finite(tree) -> jax.Array:
    """Whether every float in tree is finite: one program and one transfer to the host (one
    program per leaf would launch dozens of collectives at once on a mesh)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


class ModelMismatch(ValueError):
    """A checkpoint's parameters do not fit the configured model."""


class Checkpoints:
    """Saves every few steps (asynchronously), keeps the newest `keep`, restores the latest good one."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save)
        self._remove_unfinished()
        self._open()

    def _remove_unfinished(self):
        # Done here, before the manager opens, rather than by Orbax's own cleanup, which runs in the
        # background and may still be deleting when the first restore or listing happens.
        if jax.process_index() == 0:
            for leftover in self.directory.glob(UNFINISHED):
                shutil.rmtree(leftover)

    def _open(self):
        self.manager = ocp.CheckpointManager(self.directory, options=self._options, item_names=ITEMS)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, state: TrainState, meta: dict) -> None:
        """Saves state at its step. Refuses parameters or optimizer state with NaN or inf."""
        step = int(state.step)
        if not bool(_all_finite((state.params, state.opt_state))):
            raise FloatingPointError(f"refusing to write a checkpoint with NaN or inf values at step {step}")
        meta = {**meta, "step": step, "param_shapes": param_shapes(state.params)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params),
                opt_state=ocp.args.StandardSave(state.opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
        )

    def _set_aside(self, step: int, error: Exception) -> None:
        damaged = self.directory / f"{step}.damaged"
        (self.directory / str(step)).rename(damaged)
        warnings.warn(
            f"checkpoint at step {step} cannot be loaded ({type(error).__name__}: {str(error)[:300]}); "
            f"moved to {damaged} and skipped",
            stacklevel=3,
        )
        self._open()

    def restore_latest(self, state: TrainState) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that loads, restored into state's structure; None if none."""
        expected = param_shapes(state.params)
        for step in reversed(self.steps()):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
                if meta.get("param_shapes") != expected:
                    raise ModelMismatch(
                        f"the checkpoint at {self.directory / str(step)} belongs to a model with other "
                        "parameter shapes; start a new workdir, or load only matching parameters with "
                        "config.init.params_from"
                    )
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(_abstract(state.params)),
                        opt_state=ocp.args.StandardRestore(_abstract(state.opt_state)),
                    ),
                )
            except ModelMismatch:
                raise
            except Exception as error:  # noqa: BLE001  (Orbax and TensorStore raise many types)
                self._set_aside(step, error)
                continue
            step_array = jax.device_put(jnp.asarray(step, state.step.dtype), state.step.sharding)
            state = state.replace(step=step_array, params=restored.params, opt_state=restored.opt_state)
            return state, meta
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_params(path: str | Path, like):
    """Parameters of a saved run for fine-tuning, cast to the dtypes of `like`.

    path: a run's workdir, its checkpoints folder, or one <step> folder in it.
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
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            params = checkpointer.restore(step_dir / "params", target)
        except ValueError as error:
            raise ModelMismatch(
                f"the parameters at {step_dir} do not fit the configured model: {str(error)[:500]}"
            ) from error
    return params
