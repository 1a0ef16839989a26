"""An unsupervised exploration agent in the URLB style: DDPG driven by RND's intrinsic reward.

ExoRL's datasets are the replay buffers of such agents: they explore without a task reward,
and their episodes are relabeled with a task's reward afterwards. RNDAgent is DDPG (an actor
with Gaussian exploration noise, twin critics with a slowly tracking target) whose only
reward is Random Network Distillation's: the error of a trained predictor against a fixed
random network on the next observation (normalized observations in, normalized errors out),
high where the agent has rarely been.

bpt.rl.collect.collect_rnd runs one agent through a domain's episodes; Transitions is its
replay buffer, and save/load keep the agent's state between episodes.

Sizes are smaller than URLB's (hidden 256, RND features 64; URLB: 1024 and 512) so that a
collection runs on a CPU; RNDSettings holds them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization


@dataclasses.dataclass(frozen=True)
class RNDSettings:
    hidden: int = 256
    features: int = 64  # RND's output width
    learning_rate: float = 1e-4
    batch_size: int = 256
    discount: float = 0.99
    tau: float = 0.01  # the target critics' step toward the critics
    noise: float = 0.2  # exploration noise (std of the Gaussian added to the actor's action)
    noise_clip: float = 0.3
    seed_steps: int = 4000  # uniform random actions before the first update
    update_every: int = 2  # environment steps per update (URLB's DDPG agents: 2)
    obs_clip: float = 5.0


class Actor(nn.Module):
    hidden: int
    act_dim: int

    @nn.compact
    def __call__(self, obs):
        h = jnp.tanh(nn.LayerNorm()(nn.Dense(self.hidden)(obs)))
        h = nn.relu(nn.Dense(self.hidden)(h))
        return jnp.tanh(nn.Dense(self.act_dim)(h))


class Critic(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([obs, action], axis=-1)
        out = []
        for _ in range(2):  # twin Q heads
            h = jnp.tanh(nn.LayerNorm()(nn.Dense(self.hidden)(x)))
            h = nn.relu(nn.Dense(self.hidden)(h))
            out.append(nn.Dense(1)(h)[..., 0])
        return out


class Features(nn.Module):
    hidden: int
    features: int

    @nn.compact
    def __call__(self, obs):
        h = nn.relu(nn.Dense(self.hidden)(obs))
        h = nn.relu(nn.Dense(self.hidden)(h))
        return nn.Dense(self.features)(h)


def _moments_update(stats, x):
    """Running mean and variance (Chan's parallel update) with a batch x [n, ...]."""
    mean, var, count = stats
    n = x.shape[0]
    b_mean, b_var = jnp.mean(x, axis=0), jnp.var(x, axis=0)
    total = count + n
    delta = b_mean - mean
    new_mean = mean + delta * n / total
    new_var = (var * count + b_var * n + delta**2 * count * n / total) / total
    return new_mean, new_var, total


class RNDAgent:
    """DDPG + RND (see the module docstring); state is a pytree of arrays (saved as msgpack)."""

    def __init__(self, obs_dim: int, act_dim: int, settings: RNDSettings = RNDSettings(), seed: int = 0):
        self.obs_dim, self.act_dim, self.settings = obs_dim, act_dim, settings
        s = settings
        self.actor, self.critic = Actor(s.hidden, act_dim), Critic(s.hidden)
        self.features = Features(s.hidden, s.features)
        self.optimizer = optax.adam(s.learning_rate)
        keys = jax.random.split(jax.random.PRNGKey(seed), 5)
        obs, act = jnp.zeros((1, obs_dim)), jnp.zeros((1, act_dim))
        params = {
            "actor": self.actor.init(keys[0], obs)["params"],
            "critic": self.critic.init(keys[1], obs, act)["params"],
            "predictor": self.features.init(keys[2], obs)["params"],
        }
        self.state = {
            "params": params,
            "target_critic": params["critic"],
            "rnd_target": self.features.init(keys[3], obs)["params"],  # fixed
            "opt": {k: self.optimizer.init(v) for k, v in params.items()},
            "obs_stats": (jnp.zeros(obs_dim), jnp.ones(obs_dim), jnp.float32(1e-4)),
            "reward_stats": (jnp.zeros(()), jnp.ones(()), jnp.float32(1e-4)),
            "rng": keys[4],
            "updates": jnp.int32(0),
        }
        self.steps = 0  # environment steps taken
        self.episodes = 0

    # -------------------------------------------------------------------- acting

    def act(self, obs: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The actor's action with exploration noise (uniform before seed_steps)."""
        if self.steps < self.settings.seed_steps:
            return rng.uniform(-1.0, 1.0, self.act_dim).astype(np.float32)
        mean = np.asarray(_actor_apply(self.actor, self.state["params"]["actor"], jnp.asarray(obs)[None])[0])
        noise = np.clip(rng.normal(0.0, self.settings.noise, self.act_dim), -self.settings.noise_clip, self.settings.noise_clip)
        return np.clip(mean + noise, -1.0, 1.0).astype(np.float32)

    # -------------------------------------------------------------------- learning

    def intrinsic_reward(self, next_obs: np.ndarray) -> np.ndarray:
        """RND's reward for a batch of next observations (normalized by the running stats)."""
        return np.asarray(_intrinsic(self, self.state, jnp.asarray(next_obs))[0])

    def update(self, batch: dict) -> dict:
        """One update of RND's predictor, the critics and the actor from a batch of
        transitions {obs, action, next_obs, discount}; returns the losses."""
        self.state, metrics = _update(self, self.state, {k: jnp.asarray(v) for k, v in batch.items()})
        return {k: float(v) for k, v in metrics.items()}

    # -------------------------------------------------------------------- saving

    def save(self, path: str | os.PathLike) -> None:
        payload = {"state": self.state, "steps": np.int64(self.steps), "episodes": np.int64(self.episodes)}
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(serialization.to_bytes(payload))
        os.replace(partial, path)

    def load(self, path: str | os.PathLike) -> None:
        template = {"state": self.state, "steps": np.int64(0), "episodes": np.int64(0)}
        payload = serialization.from_bytes(template, Path(path).read_bytes())
        self.state = jax.tree.map(jnp.asarray, payload["state"])
        self.steps, self.episodes = int(payload["steps"]), int(payload["episodes"])

    def __hash__(self):  # the jitted functions take the agent as a static argument
        return hash((self.obs_dim, self.act_dim, self.settings))

    def __eq__(self, other):
        return isinstance(other, RNDAgent) and hash(self) == hash(other)


@functools.partial(jax.jit, static_argnums=0)
def _actor_apply(actor, params, obs):
    return actor.apply({"params": params}, obs)


def _normalize(obs, stats, clip):
    mean, var, _ = stats
    return jnp.clip((obs - mean) / jnp.sqrt(var + 1e-8), -clip, clip)


@functools.partial(jax.jit, static_argnums=0)
def _intrinsic(agent: RNDAgent, state, next_obs):
    x = _normalize(next_obs, state["obs_stats"], agent.settings.obs_clip)
    target = agent.features.apply({"params": state["rnd_target"]}, x)
    predicted = agent.features.apply({"params": state["params"]["predictor"]}, x)
    error = jnp.sum(jnp.square(predicted - target), axis=-1)
    return error / jnp.sqrt(state["reward_stats"][1] + 1e-8), error


@functools.partial(jax.jit, static_argnums=0)
def _update(agent: RNDAgent, state, batch):
    s = agent.settings
    state = dict(state)
    state["obs_stats"] = _moments_update(state["obs_stats"], batch["next_obs"])
    reward, raw = _intrinsic(agent, state, batch["next_obs"])
    state["reward_stats"] = _moments_update(state["reward_stats"], raw)
    reward = jax.lax.stop_gradient(reward)
    rng, k_target, k_actor = jax.random.split(state["rng"], 3)
    params = state["params"]

    def noisy(action, key):
        noise = jnp.clip(s.noise * jax.random.normal(key, action.shape), -s.noise_clip, s.noise_clip)
        return jnp.clip(action + noise, -1.0, 1.0)

    def predictor_loss(p):
        x = _normalize(batch["next_obs"], state["obs_stats"], s.obs_clip)
        target = agent.features.apply({"params": state["rnd_target"]}, x)
        return jnp.mean(jnp.sum(jnp.square(agent.features.apply({"params": p}, x) - target), axis=-1))

    next_action = noisy(agent.actor.apply({"params": params["actor"]}, batch["next_obs"]), k_target)
    next_q = jnp.minimum(*agent.critic.apply({"params": state["target_critic"]}, batch["next_obs"], next_action))
    target_q = jax.lax.stop_gradient(reward + s.discount * batch["discount"] * next_q)

    def critic_loss(p):
        q1, q2 = agent.critic.apply({"params": p}, batch["obs"], batch["action"])
        return jnp.mean(jnp.square(q1 - target_q) + jnp.square(q2 - target_q))

    def actor_loss(p, critic):
        action = noisy(agent.actor.apply({"params": p}, batch["obs"]), k_actor)
        return -jnp.mean(jnp.minimum(*agent.critic.apply({"params": critic}, batch["obs"], action)))

    losses, new_params, opt = {}, dict(params), dict(state["opt"])
    for name, loss_fn in (("predictor", predictor_loss), ("critic", critic_loss)):
        losses[name], grads = jax.value_and_grad(loss_fn)(params[name])
        updates, opt[name] = agent.optimizer.update(grads, opt[name], params[name])
        new_params[name] = optax.apply_updates(params[name], updates)
    losses["actor"], grads = jax.value_and_grad(actor_loss)(params["actor"], new_params["critic"])
    updates, opt["actor"] = agent.optimizer.update(grads, opt["actor"], params["actor"])
    new_params["actor"] = optax.apply_updates(params["actor"], updates)
    state.update(
        params=new_params,
        opt=opt,
        rng=rng,
        updates=state["updates"] + 1,
        target_critic=optax.incremental_update(new_params["critic"], state["target_critic"], s.tau),
    )
    return state, {**losses, "intrinsic_reward": jnp.mean(reward)}


class Transitions:
    """The replay buffer: every transition of the agent's episodes, sampled uniformly."""

    def __init__(self):
        self.parts = {k: [] for k in ("obs", "action", "next_obs", "discount")}
        self.size = 0
        self._arrays = None

    def add_episode(self, episode: dict) -> None:
        self.parts["obs"].append(np.asarray(episode["observation"][:-1], np.float32))
        self.parts["action"].append(np.asarray(episode["action"][1:], np.float32))
        self.parts["next_obs"].append(np.asarray(episode["observation"][1:], np.float32))
        self.parts["discount"].append(np.asarray(episode["discount"][1:, 0], np.float32))
        self.size += len(episode["observation"]) - 1
        self._arrays = None

    def sample(self, rng: np.random.RandomState, batch_size: int, pending: dict | None = None) -> dict:
        """A batch from the stored episodes and the current episode's transitions so far
        (pending: lists, as they grow; indexed, never copied whole)."""
        if self._arrays is None:
            self._arrays = {k: np.concatenate(v) for k, v in self.parts.items() if v}
        extra = len(pending["obs"]) if pending else 0
        index = rng.randint(0, self.size + extra, batch_size)
        stored, recent = index[index < self.size], index[index >= self.size] - self.size
        out = {}
        for k in self.parts:
            chunks = [self._arrays[k][stored]] if self.size else []
            if len(recent):
                chunks.append(np.asarray([pending[k][i] for i in recent], np.float32))
            out[k] = np.concatenate(chunks)
        return out
