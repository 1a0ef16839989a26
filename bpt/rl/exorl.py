"""ExoRL-format episodes from dm_control: the file layout, the environments, reward relabeling.

ExoRL (Yarats et al. 2022) stores the replay buffers of unsupervised exploration agents, one
episode a file, and relabels each transition with a task's reward afterwards. bpt writes and
reads the same layout, so a folder collected here and a real ExoRL download load alike:

    ROOT/<domain>/buffer/<name>_<length>.npz        (also ROOT/<domain>/<agent>/buffer/...)

One file holds T + 1 rows of each key; row 0 is the reset state with a dummy action (zeros),
reward 0 and discount 1, and row t >= 1 is what came of taking action[t] in observation[t - 1]:

    observation  [T + 1, obs_dim] float32   the flattened dm_control observation
    action       [T + 1, act_dim] float32
    reward       [T + 1, 1]       float32   the collecting task's reward (relabel replaces it)
    discount     [T + 1, 1]       float32
    physics      [T + 1, state]   float64   physics.get_state(): qpos, qvel, act

relabel(episode, task) recomputes a task's reward for every row from the stored physics state,
exactly as dm_control computes it online after a step. A task whose reward also reads the
control (cartpole's swing-up: a small-control term) gets the stored action as the control; an
ExoRL relabel that restores only the state would give it the control of the last step instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

os.environ.setdefault("MUJOCO_GL", "disable")  # states only: no rendering context is needed

KEYS = ("observation", "action", "reward", "discount", "physics")
# The task a domain's reward-free collection runs in (its reward is stored but not used).
COLLECTION_TASKS = {"walker": "stand", "cheetah": "run", "cartpole": "swingup", "hopper": "stand",
                    "quadruped": "walk", "point_mass": "easy", "reacher": "easy", "jaco": "reach_top_left"}  # fmt: skip
# The paper's five suite tasks; its sixth, jaco reach, is URLB's own task (bpt.rl.jaco).
TASKS = ("walker_stand", "walker_run", "walker_walk", "cheetah_run", "cartpole_swingup")
JACO_TASKS = ("reach_top_left", "reach_top_right", "reach_bottom_left", "reach_bottom_right")
_NAME = re.compile(r"^(?P<name>.+)_(?P<length>\d+)\.npz$")


def all_tasks() -> tuple[tuple[str, str], ...]:
    """(domain, task) of every task: dm_control's suite, then jaco's (bpt.rl.jaco)."""
    from dm_control import suite

    return tuple(suite.ALL_TASKS) + tuple(("jaco", name) for name in JACO_TASKS)


def split_task(task: str) -> tuple[str, str]:
    """'walker_walk' -> ('walker', 'walk'), by dm_control's own domain names."""
    for domain, name in all_tasks():
        if task == f"{domain}_{name}":
            return domain, name
    known = ", ".join(f"{d}_{t}" for d, t in all_tasks())
    raise ValueError(
        f"task must be a dm_control suite or jaco task as domain_task; got {task!r} (known: {known})"
    )


def make_env(domain: str, task: str | None = None, seed: int = 0, time_limit: float | None = None):
    """A dm_control environment (states only): a suite task, or jaco's (bpt.rl.jaco). task:
    the task's name within the domain (default: the domain's collection task); time_limit:
    seconds an episode lasts (default the task's own: 1000 steps for walker, cheetah and
    cartpole, 250 for jaco)."""
    from dm_control import suite

    if domain == "jaco":
        from bpt.rl import jaco

        return jaco.make(task or COLLECTION_TASKS["jaco"], seed=seed, time_limit=time_limit)
    tasks = [t for d, t in suite.ALL_TASKS if d == domain]
    task = task or COLLECTION_TASKS.get(domain) or (tasks[0] if tasks else None)
    if (domain, task) not in suite.ALL_TASKS:
        if not tasks:
            domains = sorted({d for d, _ in all_tasks()})
            raise ValueError(
                f"domain must be a dm_control suite domain or jaco ({', '.join(domains)}); got {domain!r}"
            )
        raise ValueError(f"task {task!r} is not one of {domain}'s: {', '.join(sorted(tasks))}")
    limit = {} if time_limit is None else {"time_limit": time_limit}  # every suite task takes it
    return suite.load(domain, task, task_kwargs={"random": seed, **limit})


def episode_steps(env) -> int:
    """Steps an episode of env lasts (a suite environment's or a composer one's, as jaco's)."""
    if hasattr(env, "_step_limit"):  # dm_control.rl.control.Environment
        return int(env._step_limit)
    return int(round(env._time_limit / env.control_timestep()))


def seed_episode(env, seed: int) -> None:
    """Seeds the initial state of env's next reset (suite: its task's random state; composer:
    the environment's)."""
    random = env.task.random if hasattr(env.task, "random") else env.random_state
    random.seed(seed % 2**32)


def flatten_observation(observation) -> np.ndarray:
    """dm_control's observation dict as one float32 vector, in the dict's order (as URLB)."""
    return np.concatenate([np.asarray(v, np.float32).ravel() for v in observation.values()])


def buffer_dir(root: str | os.PathLike, domain: str) -> Path:
    return Path(root) / domain / "buffer"


def episode_path(root, domain: str, name: str, length: int) -> Path:
    return buffer_dir(root, domain) / f"{name}_{length}.npz"


def episode_length(episode: dict) -> int:
    """Transitions in an episode: its rows less the reset row."""
    return len(episode["observation"]) - 1


def save_episode(path: str | os.PathLike, episode: dict) -> Path:
    """Writes one episode; the file appears whole or not at all (written aside, then renamed)."""
    missing = [k for k in KEYS if k not in episode]
    if missing:
        raise ValueError(f"an episode needs the keys {', '.join(KEYS)}; missing {', '.join(missing)}")
    rows = {k: len(episode[k]) for k in KEYS}
    if len(set(rows.values())) != 1:
        raise ValueError(f"every key of an episode has T + 1 rows; got {rows}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.savez(f, **{k: np.asarray(episode[k]) for k in KEYS})
    os.replace(partial, path)
    return path


def load_episode(path: str | os.PathLike) -> dict:
    with np.load(path) as data:
        missing = [k for k in KEYS if k not in data and k != "physics"]
        if missing:
            raise ValueError(f"{path} is not an ExoRL episode: no {', '.join(missing)}")
        return {k: data[k] for k in data.files}


def episode_files(root: str | os.PathLike, domain: str | None = None) -> list[Path]:
    """The episode files under root, sorted by name: root/<domain>/buffer/*.npz (also one agent
    folder deeper, as ExoRL's datasets/<domain>/<agent>/buffer), or root/buffer/*.npz, or
    root/*.npz."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no episode folder at {root}")
    bases = [root / domain] if domain else []
    bases.append(root)
    for base in bases:
        for pattern in ("buffer/*.npz", "*/buffer/*.npz", "*.npz"):
            files = sorted(p for p in base.glob(pattern) if _NAME.match(p.name))
            if files:
                return files
    where = f"{root}/{domain}/buffer" if domain else f"{root}/buffer"
    raise FileNotFoundError(f"no episodes (<name>_<length>.npz) under {root}; expected them in {where}")


def relabel(episode: dict, task: str, env=None) -> np.ndarray:
    """The task's reward [T + 1, 1] for every row of the episode, from its physics states.

    Row t's reward is the task's reward in the state the step into row t ended in, with the
    control that step applied (action[t]); row 0 (the reset state, no step) is computed the
    same way with the dummy action. env: a make_env of the task's domain to reuse."""
    if "physics" not in episode:
        raise ValueError("relabel needs the episode's physics states (the 'physics' key)")
    domain, name = split_task(task)
    env = env or make_env(domain, name)
    physics, states = env.physics, np.asarray(episode["physics"])
    if states.shape[1] != physics.get_state().shape[0]:
        raise ValueError(
            f"the episode's physics states have {states.shape[1]} values; {domain}'s have "
            f"{physics.get_state().shape[0]} (an episode of another domain?)"
        )
    actions = np.asarray(episode["action"])
    rewards = np.empty((len(states), 1), env.reward_spec().dtype)
    for t, state in enumerate(states):
        with physics.reset_context():
            physics.set_state(state)
            physics.set_control(actions[t])
        rewards[t, 0] = env.task.get_reward(physics)
    return rewards


def episode_name(path: str | os.PathLike) -> str:
    match = _NAME.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not named <name>_<length>.npz")
    return match["name"]
