"""data.name='exorl': chains of ExoRL-format trajectories as bpt-train's batches.

A batch is {"tokens": the chain inputs (bpt.models.agentic.INPUTS), "targets": the actions,
"loss_mask": the real steps}; model.family='agentic' reads it. Settings (config.data):

    path            the ExoRL root (bpt-collect-exorl's --out, or ExoRL's datasets/ folder)
    task            the task whose reward relabels the episodes (walker_walk, ...)
    trajectories    trajectories a chain (AT: 4 or 32; Decision Transformer and BC: 1)
    episode_length  steps a trajectory (dm_control's 1000); data.seq_len must be
                    4 x trajectories x episode_length
    best_fraction   keep the best fraction of the training trajectories by return (BC-10%: 0.1)
    val_fraction    the last episodes (by name) held out for evaluation (default 0.05)

Relabeled rewards are cached next to the episodes (<domain>/relabeled_<task>.npz, by file
name), so a second run of the same task does not replay the physics.
"""

from __future__ import annotations

import numpy as np

from bpt.data.datasets import process_rows, register_dataset
from bpt.models.agentic import TOKENS_PER_STEP
from bpt.rl import exorl
from bpt.rl.sequences import Trajectory, best_fraction, sample_chains, trajectory

VAL_FRACTION = 0.05


def cache_path(root, task: str):
    """Where the task's relabeled rewards are cached: beside its domain's episode folder."""
    domain, _ = exorl.split_task(task)
    return exorl.episode_files(root, domain)[0].parent.parent / f"relabeled_{task}.npz"


def relabeled(root, task: str, *, progress: bool = True) -> list[tuple[str, Trajectory]]:
    """(name, trajectory) of every episode of the task's domain, relabeled for the task
    (rewards cached beside the episodes when the folder is writable)."""
    from tqdm.auto import tqdm

    domain, name = exorl.split_task(task)
    files = exorl.episode_files(root, domain)
    cache = cache_path(root, task)
    cached = {}
    if cache.is_file():
        with np.load(cache) as data:
            cached = {k: data[k] for k in data.files}
    env, out, fresh = None, [], 0
    for path in tqdm(files, desc=f"episodes ({task})", unit="episode", disable=not progress):
        episode = exorl.load_episode(path)
        rewards = cached.get(path.name)
        if rewards is None or len(rewards) != len(episode["observation"]):
            env = env or exorl.make_env(domain, name)
            rewards = cached[path.name] = exorl.relabel(episode, task, env)
            fresh += 1
        out.append((path.name, trajectory(episode, rewards)))
    if fresh:
        try:
            partial = cache.with_name(cache.name + ".partial")
            with open(partial, "wb") as f:
                np.savez(f, **cached)
            partial.replace(cache)
        except OSError:  # a read-only dataset: relabel again next time
            pass
    return out


class ExoRLDataset:
    """Chains of relabeled trajectories (see the module docstring), sliced for this process."""

    vocab_size = 1  # no tokens: AT embeds its inputs

    def __init__(self, data, seed: int, *, process_index: int = 0, process_count: int = 1, progress: bool = True):
        if not data.path:
            raise ValueError("data.name='exorl' needs data.path: an ExoRL folder (bpt-collect-exorl --out)")
        self.n, self.length, self.seed = data.trajectories, data.episode_length, seed
        self.process_index, self.process_count = process_index, process_count
        if data.seq_len != TOKENS_PER_STEP * self.n * self.length:
            raise ValueError(
                f"data.seq_len must be {TOKENS_PER_STEP} x data.trajectories x data.episode_length = "
                f"{TOKENS_PER_STEP * self.n * self.length}; got {data.seq_len}"
            )
        episodes = relabeled(data.path, data.task, progress=progress)
        longest = max(len(t.rewards) for _, t in episodes)
        if longest > self.length:
            raise ValueError(f"the episodes have up to {longest} steps; data.episode_length is {self.length}")
        if longest < self.length and progress and process_index == 0:
            print(
                f"note: the episodes of {data.path} have at most {longest} steps; each trajectory is padded "
                f"to data.episode_length={self.length} (chains of {data.seq_len} tokens, the padding masked). "
                f"For chains of the data's length: configs/rl/at.py:{data.task},{self.n},{longest}"
            )
        fraction = VAL_FRACTION if data.val_fraction is None else data.val_fraction
        held = min(len(episodes) - 1, max(1, int(round(fraction * len(episodes))))) if len(episodes) > 1 else 0
        self.train = [t for _, t in episodes[: len(episodes) - held]]
        self.val = [t for _, t in episodes[len(episodes) - held :]] or self.train
        if data.best_fraction < 1.0:
            self.train = best_fraction(self.train, data.best_fraction)
        if self.n > len(self.train):
            raise ValueError(
                f"data.trajectories={self.n} is more than the {len(self.train)} training trajectories of "
                f"{data.path} (after data.best_fraction={data.best_fraction}); collect more episodes"
            )
        first = self.train[0]
        self.model_fields = {
            "obs_dim": first.states.shape[1],
            "act_dim": first.actions.shape[1],
            "max_timestep": self.length,
        }
        self.returns = np.array([t.total for t in self.train])

    def _batch(self, pool: list[Trajectory], rng: np.random.Generator, batch_size: int) -> dict:
        mine = process_rows(batch_size, self.process_index, self.process_count)
        inputs = sample_chains(pool, self.n, batch_size, rng, length=self.length, rows=mine)
        mask = inputs.pop("mask")
        inputs.pop("trajectory")  # (the model reads the order from the positions)
        return {"tokens": inputs, "targets": inputs["actions"], "loss_mask": mask}

    def train_batch(self, step: int, batch_size: int) -> dict:
        """This process's part of the global batch of `step` (batch_size is global)."""
        return self._batch(self.train, np.random.default_rng([self.seed, step]), batch_size)

    def eval_batches(self, num_batches: int, batch_size: int) -> list[dict]:
        """Chains of the held-out trajectories; the same every call."""
        rng = np.random.default_rng([self.seed, 1, 0])
        return [self._batch(self.val, rng, batch_size) for _ in range(num_batches)]


register_dataset("exorl", ExoRLDataset)
