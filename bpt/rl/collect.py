"""Reward-free collection of dm_control episodes in ExoRL's layout (bpt.rl.exorl).

collect(domain, episodes, out, agent=...) runs episodes in worker processes and writes each
one as it finishes, named <agent>_<index>_<length>.npz. Episode i is seeded from (seed, i)
alone, so an interrupted collection resumes where it stopped (the episodes already on disk
are skipped) and gives the same files as an uninterrupted one; a file appears whole or not at
all.

Agents (AGENTS): "random" takes uniform actions within the action bounds, episodes in
parallel; "rnd" is one learning agent, DDPG driven by RND's intrinsic reward, as URLB's
(bpt.rl.agents): its episodes are sequential, and it resumes from its saved state.

collect_rnd runs that agent through episodes 0..N-1 of a domain and writes each episode as it
ends (named rnd_<index>_<length>.npz); its replay buffer is those episodes. After each
episode the agent's state (networks, optimizers, running statistics, steps) is saved beside
them (rnd_agent.msgpack), so an interrupted collection resumes with the agent where it was
and the buffer read back from the files.
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from bpt.rl import exorl
from bpt.rl.agents import RNDAgent, RNDSettings, Transitions

AGENTS = ("random", "rnd")


def episode_seed(seed: int, index: int) -> int:
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def run_episode(env, policy, rng: np.random.RandomState, on_step=None) -> dict:
    """One episode of env under policy(observation, rng) -> action, as ExoRL stores it;
    on_step(observation, action, next_observation, discount) sees each transition."""
    spec = env.action_spec()
    step = env.reset()
    rows = {k: [] for k in exorl.KEYS}

    def record(step, action):
        rows["observation"].append(exorl.flatten_observation(step.observation))
        rows["action"].append(np.asarray(action, np.float32))
        rows["reward"].append(np.float32([step.reward or 0.0]))
        rows["discount"].append(np.float32([1.0 if step.discount is None else step.discount]))
        rows["physics"].append(env.physics.get_state().copy())

    record(step, np.zeros(spec.shape, np.float32))  # the reset row: a dummy action
    while not step.last():
        observation = rows["observation"][-1]
        action = np.clip(policy(observation, rng), spec.minimum, spec.maximum).astype(np.float32)
        step = env.step(action)
        record(step, action)
        if on_step is not None:
            on_step(observation, action, rows["observation"][-1], rows["discount"][-1][0])
    return {k: np.stack(v) for k, v in rows.items()}


def random_policy(spec):
    return lambda observation, rng: rng.uniform(spec.minimum, spec.maximum, spec.shape).astype(np.float32)


_ENVS: dict = {}  # one environment per worker process and domain


def _collect_one(domain: str, agent: str, index: int, seed: int, out: str, time_limit: float | None = None) -> str:
    key = (domain, time_limit)
    env = _ENVS.get(key) or _ENVS.setdefault(key, exorl.make_env(domain, time_limit=time_limit))
    episode_seed_ = episode_seed(seed, index)
    exorl.seed_episode(env, episode_seed_)  # the reset's initial state
    rng = np.random.RandomState(episode_seed_ % 2**32 ^ 0x5EED)
    if agent != "random":
        raise ValueError(f"workers collect the random agent's episodes; got {agent!r}")
    policy = random_policy(env.action_spec())
    episode = run_episode(env, policy, rng)
    name = f"{agent}_{index:06d}"
    return str(
        exorl.save_episode(exorl.episode_path(out, domain, name, exorl.episode_length(episode)), episode)
    )


def collected(out: str | os.PathLike, domain: str, agent: str) -> set[int]:
    """Indices of the agent's episodes already on disk."""
    folder = exorl.buffer_dir(out, domain)
    done = set()
    for path in folder.glob(f"{agent}_*.npz") if folder.is_dir() else ():
        index = exorl.episode_name(path)[len(agent) + 1 :]
        if index.isdigit():
            done.add(int(index))
    return done


def collect(
    domain: str,
    episodes: int,
    out: str | os.PathLike,
    *,
    agent: str = "random",
    workers: int = 1,
    seed: int = 0,
    time_limit: float | None = None,
    progress: bool = True,
) -> list[Path]:
    """Collects episodes 0..episodes-1 of the agent in domain under out (see the module
    docstring); returns the paths of the episodes written by this call. time_limit: seconds
    an episode lasts (default the task's own, 1000 steps for walker, cheetah, cartpole)."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {', '.join(AGENTS)}; got {agent!r}")
    if episodes < 1 or workers < 1:
        raise ValueError(f"episodes and workers must be >= 1; got {episodes} and {workers}")
    exorl.make_env(domain, time_limit=time_limit)  # a bad domain fails here, before any process starts
    if agent == "rnd":
        if workers != 1:
            raise ValueError("the rnd agent is one learner whose episodes follow each other: use num_workers=1")
        return collect_rnd(domain, episodes, out, seed=seed, time_limit=time_limit, progress=progress)
    todo = sorted(set(range(episodes)) - collected(out, domain, agent))
    written = []
    if not todo:
        return written
    bar = tqdm(total=episodes, initial=episodes - len(todo), desc=f"{domain} {agent}", unit="episode",
               disable=not progress)  # fmt: skip
    if workers == 1:
        for index in todo:
            written.append(Path(_collect_one(domain, agent, index, seed, str(out), time_limit)))
            bar.update()
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_collect_one, domain, agent, i, seed, str(out), time_limit) for i in todo]
            for future in as_completed(futures):
                written.append(Path(future.result()))
                bar.update()
    bar.close()
    return sorted(written)


def collect_rnd(
    domain: str,
    episodes: int,
    out: str | os.PathLike,
    *,
    seed: int = 0,
    time_limit: float | None = None,
    settings: RNDSettings | None = None,
    progress: bool = True,
) -> list[Path]:
    """One RND agent's episodes 0..episodes-1 in domain, under out (see the module
    docstring); returns the paths written by this call. settings: RNDSettings() by default."""
    settings = settings or RNDSettings()
    env = exorl.make_env(domain, time_limit=time_limit)
    obs_dim = exorl.flatten_observation(env.reset().observation).shape[0]
    agent = RNDAgent(obs_dim, env.action_spec().shape[0], settings, seed)
    folder = exorl.buffer_dir(out, domain)
    checkpoint = folder / "rnd_agent.msgpack"
    done = sorted(collected(out, domain, "rnd"))
    if done != list(range(len(done))):
        raise ValueError(f"{folder} holds rnd episodes {done[:5]}...: not a prefix 0..n-1 (an RND agent's episodes are sequential)")
    buffer = Transitions()
    for path in sorted(folder.glob("rnd_*.npz")):
        buffer.add_episode(exorl.load_episode(path))
    if checkpoint.is_file():
        agent.load(checkpoint)
    elif done:
        raise FileNotFoundError(f"{folder} has rnd episodes but no {checkpoint.name}: the agent cannot resume")
    agent.episodes = len(done)  # episodes written after the agent's last save stay in its buffer
    written = []
    bar = tqdm(total=episodes, initial=len(done), desc=f"{domain} rnd", unit="episode", disable=not progress)
    for index in range(len(done), episodes):
        e_seed = episode_seed(seed, index)
        exorl.seed_episode(env, e_seed)
        rng = np.random.RandomState(e_seed % 2**32 ^ 0x5EED)
        pending = {k: [] for k in ("obs", "action", "next_obs", "discount")}

        def policy(obs, rng, pending=pending):
            action = agent.act(obs, rng)
            if pending["obs"] or buffer.size:  # learn from what is there
                if agent.steps >= settings.seed_steps and agent.steps % settings.update_every == 0:
                    agent.update(buffer.sample(rng, settings.batch_size, pending))
            agent.steps += 1
            return action

        def on_step(obs, action, next_obs, discount, pending=pending):
            for k, v in zip(("obs", "action", "next_obs", "discount"), (obs, action, next_obs, discount)):
                pending[k].append(v)

        episode = run_episode(env, policy, rng, on_step=on_step)
        name = f"rnd_{index:06d}"
        written.append(exorl.save_episode(exorl.episode_path(out, domain, name, exorl.episode_length(episode)), episode))
        buffer.add_episode(episode)
        agent.episodes = index + 1
        agent.save(checkpoint)
        bar.update()
    bar.close()
    return written
