"""Trajectories from ExoRL-format episodes, and the chains of trajectories the Agentic
Transformer (AT) trains on.

A trajectory is an episode's T transitions: state s_t (observation row t), the action a_t
taken in it (action row t + 1) and the reward r_t that followed (reward row t + 1, relabeled
for a task). AT reads several trajectories in one sequence, a chain of hindsight experience:

- the chain's trajectories are sorted by return, ascending, so the sequence shows a way from
  worse to better;
- every trajectory is relabeled with the chain's best return as its target (hindsight): its
  return-to-go at step t is target - (the rewards before t), so a trajectory that fell short
  ends with the amount it fell short by;
- a completion flag says which trajectories reached the target (the best one, and any tied
  with it).

Decision Transformer is the chain of one trajectory (its own return as the target); BC-10%
trains on the best 10% of trajectories by return (best_fraction).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Trajectory(NamedTuple):
    states: np.ndarray  # [T, obs_dim] float32
    actions: np.ndarray  # [T, act_dim] float32
    rewards: np.ndarray  # [T] float32

    @property
    def total(self) -> float:
        return float(np.sum(self.rewards, dtype=np.float64))


def trajectory(episode: dict, rewards: np.ndarray | None = None) -> Trajectory:
    """The transitions of an ExoRL episode; rewards [T + 1, 1] (relabel's) replace the stored."""
    rewards = episode["reward"] if rewards is None else rewards
    return Trajectory(
        np.asarray(episode["observation"][:-1], np.float32),
        np.asarray(episode["action"][1:], np.float32),
        np.asarray(rewards, np.float32).reshape(-1)[1:],
    )


def best_fraction(trajectories: list[Trajectory], fraction: float = 0.1) -> list[Trajectory]:
    """The best `fraction` of the trajectories by return (at least one): BC-10%'s data."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1]; got {fraction}")
    ranked = sorted(trajectories, key=lambda t: t.total, reverse=True)
    return ranked[: max(1, int(round(fraction * len(ranked))))]


def chain(trajectories: list[Trajectory], *, length: int | None = None) -> dict[str, np.ndarray]:
    """One AT training sequence from the trajectories (see the module docstring): arrays over
    the chain's steps, trajectory after trajectory, each padded to `length` steps (default the
    longest's):

        states [N * L, obs_dim], actions [N * L, act_dim], rewards [N * L],
        returns_to_go [N * L] (to the chain's target), completion [N * L] (1.0 on every step of
        a trajectory that reached the target), trajectory [N * L] (its rank in the chain),
        timestep [N * L], mask [N * L] (1.0 on real steps, 0.0 on padding)
    """
    if not trajectories:
        raise ValueError("a chain needs at least one trajectory")
    ordered = sorted(trajectories, key=lambda t: t.total)
    target = ordered[-1].total
    length = length or max(len(t.rewards) for t in ordered)
    if any(len(t.rewards) > length for t in ordered):
        raise ValueError(f"a trajectory is longer than length={length}")
    n, obs_dim, act_dim = len(ordered), ordered[0].states.shape[1], ordered[0].actions.shape[1]
    out = {
        "states": np.zeros((n, length, obs_dim), np.float32),
        "actions": np.zeros((n, length, act_dim), np.float32),
        "rewards": np.zeros((n, length), np.float32),
        "returns_to_go": np.zeros((n, length), np.float32),
        "completion": np.zeros((n, length), np.float32),
        "trajectory": np.repeat(np.arange(n, dtype=np.int32)[:, None], length, axis=1),
        "timestep": np.repeat(np.arange(length, dtype=np.int32)[None], n, axis=0),
        "mask": np.zeros((n, length), np.float32),
    }
    for i, t in enumerate(ordered):
        steps = len(t.rewards)
        out["states"][i, :steps] = t.states
        out["actions"][i, :steps] = t.actions
        out["rewards"][i, :steps] = t.rewards
        before = np.concatenate([[0.0], np.cumsum(t.rewards, dtype=np.float64)[:-1]])
        out["returns_to_go"][i, :steps] = target - before
        out["completion"][i, :steps] = float(t.total >= target)
        out["mask"][i, :steps] = 1.0
    return {k: v.reshape(n * length, *v.shape[2:]) for k, v in out.items()}


def sample_chains(
    pool: list[Trajectory],
    num_trajectories: int,
    batch_size: int,
    rng: np.random.Generator,
    *,
    length: int | None = None,
    rows: slice = slice(None),
) -> dict[str, np.ndarray]:
    """batch_size chains (chain) of num_trajectories trajectories each, drawn from pool with
    rng: distinct within a chain where the pool holds that many, with replacement where it
    is smaller (a held-out pool). Every row's draw is made, the same on every process; rows
    picks the ones built (a process's part). length: steps a trajectory (default the pool's
    longest). Arrays [rows, ...], stacked."""
    if num_trajectories < 1:
        raise ValueError(f"num_trajectories must be >= 1; got {num_trajectories}")
    length = length or max(len(t.rewards) for t in pool)
    replace = num_trajectories > len(pool)
    picks = [rng.choice(len(pool), num_trajectories, replace=replace) for _ in range(batch_size)]
    chains = [chain([pool[i] for i in row], length=length) for row in picks[rows]]
    return {k: np.stack([c[k] for c in chains]) for k in chains[0]}
