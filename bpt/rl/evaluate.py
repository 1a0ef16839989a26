"""Rollouts of the Agentic Transformer in dm_control, with a key/value cache.

AT at test time plays several trials in a row in one context: each trial is conditioned on
the target return (completion flag 1: asked to reach it) and on its own earlier trials, which
stay in the context (returns-to-go to the same target), so it can improve from trial to
trial. By default they stay as they were played, flag 1 included; with hindsight=True a
finished trial is relabeled as the training chains label theirs (flag 1 only if it reached
the target, else 0) and its part of the cache is computed again, so the context the next
trial sees looks like a training chain's. Episodes run in parallel environments, one per
row of the batch.

A step's action is read at its state token, which sees neither the action nor the reward
after it; so each call feeds the previous step, now with its real action and reward, and the
current step with placeholders (zeros), and then sets the cache's index back to the current
step, which the next call writes again in full. One call of 8 tokens an environment step,
over a cache of trials x episode length x 4 slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bpt.models.agentic import TOKENS_PER_STEP, AgenticTransformer
from bpt.rl import exorl


def init_cache(model: AgenticTransformer, batch: int, steps: int):
    """An empty cache for `steps` steps (TOKENS_PER_STEP slots each) of `batch` chains."""
    dummy = model.example_inputs(batch, steps)
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dummy, decode=True)["cache"])
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def rollout(
    model: AgenticTransformer,
    params,
    task: str,
    *,
    episodes: int = 1,
    trials: int = 1,
    target_return: float,
    seed: int = 0,
    time_limit: float | None = None,
    episode_length: int | None = None,
    hindsight: bool = False,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """`episodes` environments of the task, each playing `trials` trials in one context.

    Returns returns [episodes, trials] (each trial's undiscounted return) and the chain that
    was fed (states, actions, rewards, returns_to_go, completion, timestep: [episodes,
    trials x steps, ...]), so the rollout can be checked against the model's full forward.
    time_limit (seconds) or episode_length (steps): how long an episode lasts (default the
    task's own). hindsight: relabel each finished trial's completion flag by its return (see
    the module docstring); the chain returned holds the flags as relabeled."""
    from tqdm.auto import tqdm

    domain, name = exorl.split_task(task)
    if episode_length is not None:
        time_limit = episode_length * exorl.make_env(domain, name).control_timestep()
    envs = [exorl.make_env(domain, name, seed=seed + i, time_limit=time_limit) for i in range(episodes)]
    length = exorl.episode_steps(envs[0])
    cfg = model.config
    if length > cfg.max_timestep:
        raise ValueError(f"the task's episodes have {length} steps; model.max_timestep is {cfg.max_timestep}")
    total = trials * length
    cache = init_cache(model, episodes, total)

    @functools.partial(jax.jit, donate_argnums=0)  # the cache is updated in place, not copied a step
    def act(cache, inputs, index):
        cache = {**cache, "index": jnp.full_like(cache["index"], index)}
        out, variables = model.apply(
            {"params": params, "cache": cache}, inputs, decode=True, mutable=["cache"]
        )
        return out[:, -1], variables["cache"]

    chain = {k: np.zeros(v.shape, v.dtype) for k, v in model.example_inputs(episodes, total).items()}
    returns = np.zeros((episodes, trials))
    bar = tqdm(total=total, desc=f"{task} rollout", unit="step", disable=not progress)
    for trial in range(trials):
        steps = [env.reset() for env in envs]
        for t in range(length):
            g = trial * length + t
            chain["states"][:, g] = [exorl.flatten_observation(s.observation) for s in steps]
            chain["returns_to_go"][:, g] = target_return - returns[:, trial]
            chain["completion"][:, g] = 1.0
            chain["timestep"][:, g] = t
            first = max(g - 1, 0)  # the previous step (now complete) and this one
            window = {k: jnp.asarray(v[:, first : g + 1]) for k, v in chain.items()}
            action, cache = act(cache, window, TOKENS_PER_STEP * first)
            action = np.asarray(action, np.float32)
            steps = [env.step(a) for env, a in zip(envs, action)]
            chain["actions"][:, g] = action
            chain["rewards"][:, g] = [s.reward for s in steps]
            returns[:, trial] += chain["rewards"][:, g]
            bar.update()
        if hindsight and trial + 1 < trials:  # the trial again, as a training chain labels it
            start = trial * length
            done = returns[:, trial] >= target_return
            chain["completion"][:, start : start + length] = done[:, None].astype(np.float32)
            window = {k: jnp.asarray(v[:, start : start + length]) for k, v in chain.items()}
            _, cache = act(cache, window, TOKENS_PER_STEP * start)
    bar.close()
    return {"returns": returns, **chain}
