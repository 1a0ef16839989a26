"""The Agentic Transformer (AT; Liu & Abbeel 2023) on bpt's GPT layers.

AT reads a chain of trajectories (bpt.rl.sequences.chain: sorted by return, returns-to-go to
the chain's best return, a completion flag) and predicts each action. Every step of the chain
is four tokens, in this order:

    return-to-go (+ the completion flag)   state   action   reward

each a linear map of its values to d_model, plus a learned embedding of the step's time
within its episode. The action at step t is regressed (tanh, the actions' [-1, 1] bounds)
from the output at step t's state token, which the causal mask lets see the return-to-go
it is asked for and everything before, never the action itself. The layer stack is the
GPT's own (bpt.models.gpt.Block through CausalLM.layers): the attention modes vanilla,
memory_efficient and blockwise_parallel, the kernels, remat and scan all apply, so a chain of
32 trajectories of 1000 steps is 128K tokens of ordinary long-context training.

Decision Transformer is the same model on chains of one trajectory.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from bpt.models.gpt import GPT, GPTConfig
from bpt.models.lm import logical_param
from bpt.ops.chunked import Loss

Array = jax.Array
TOKENS_PER_STEP = 4  # return-to-go, state, action, reward
INPUTS = ("states", "actions", "rewards", "returns_to_go", "completion", "timestep")
ACCURATE = 0.1  # an action counts as accurate when every value is within this of the target


@dataclasses.dataclass(frozen=True)
class AgenticConfig(GPTConfig):
    """A GPTConfig (vocab_size is unused: set it to 1) and the environment's shapes."""

    obs_dim: int = 1
    act_dim: int = 1
    max_timestep: int = 1000  # the episode length: size of the timestep embedding
    return_scale: float = 0.001  # returns-to-go and rewards are multiplied by this on input
    # False: the return-to-go, completion and reward tokens carry only their timestep (BC:
    # actions from states and actions alone)
    returns_input: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.check_positive("obs_dim", "act_dim", "max_timestep")
        if not self.return_scale > 0:
            raise ValueError(f"model.return_scale must be > 0; got {self.return_scale!r}")

    @property
    def summary(self) -> str:
        return f"Agentic Transformer: obs {self.obs_dim}, actions {self.act_dim}, {GPTConfig.summary.fget(self)}"


class AgenticTransformer(GPT):
    """AT over a batch of chains: inputs INPUTS as bpt.rl.sequences.chain gives them, each
    [batch, steps(, dim)]; returns the predicted actions [batch, steps, act_dim] (float32)."""

    config: AgenticConfig
    language_model = False

    @nn.compact
    def __call__(
        self,
        inputs: dict,
        *,
        targets: Array | None = None,
        loss_mask: Array | None = None,
        segment_ids: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> Array | Loss:
        """The predicted actions; given targets (the actions [batch, steps, act_dim]) and
        loss_mask [batch, steps], the loss record of bpt's training loop instead: loss = the
        masked mean squared error (action_loss), num_tokens = the steps counted, accuracy =
        the fraction of them whose every action value is within ACCURATE of the target.
        segment_ids: not used (a chain is one sequence).

        decode=True reads and updates the cache (collection "cache", made by init with
        decode=True on a chain as long as the cache): the inputs' steps go at the cache's
        index, attending to it, and the index moves past them (bpt.rl.evaluate sets it back to
        re-read a step whose action it has since taken)."""
        cfg = self.config
        missing = [k for k in INPUTS if k not in inputs]
        if missing:
            raise ValueError(f"AT's inputs need {', '.join(INPUTS)}; missing {', '.join(missing)}")
        dtype = jnp.dtype(cfg.dtype)
        batch, steps = inputs["rewards"].shape
        gate = 1.0 if cfg.returns_input else 0.0
        scalar = lambda x: (jnp.asarray(x, jnp.float32) * cfg.return_scale * gate)[..., None]  # noqa: E731
        tokens = jnp.stack(
            [
                self.linear("returns_to_go_in", scalar(inputs["returns_to_go"]))
                + self.linear("completion_in", gate * jnp.asarray(inputs["completion"], jnp.float32)[..., None]),
                self.linear("state_in", inputs["states"]),
                self.linear("action_in", inputs["actions"]),
                self.linear("reward_in", scalar(inputs["rewards"])),
            ],
            axis=2,
        )  # [batch, steps, 4, d]
        time_table = logical_param(
            self, "timestep_embedding", (cfg.max_timestep, cfg.d_model), ("positions", "embed"),
            nn.initializers.normal(0.02),
        )  # fmt: skip
        timestep = jnp.clip(jnp.asarray(inputs["timestep"], jnp.int32), 0, cfg.max_timestep - 1)
        tokens = tokens + jnp.take(time_table, timestep, axis=0)[:, :, None]
        x = tokens.reshape(batch, steps * TOKENS_PER_STEP, cfg.d_model).astype(dtype)
        cache_index, positions = None, jnp.arange(x.shape[1])
        if decode:  # (init makes the cache: a prefill of the chain's length)
            extend = not self.is_initializing()
            cache_index, positions = self.decode_positions(jnp.zeros(x.shape[:2], jnp.int32), extend)
        x = self.stack(x, positions, None, cache_index, deterministic=deterministic, decode=decode)
        norm, norm_params = self.final_norm()
        states_out = norm(norm_params, x).reshape(batch, steps, TOKENS_PER_STEP, cfg.d_model)[:, :, 1]
        actions = jnp.tanh(self.linear("action_out", states_out.astype(jnp.float32), out=cfg.act_dim))
        if targets is None:
            return actions
        mask = jnp.ones(actions.shape[:2], jnp.float32) if loss_mask is None else loss_mask.astype(jnp.float32)
        count = jnp.sum(mask)
        close = jnp.all(jnp.abs(actions - targets) <= ACCURATE, axis=-1).astype(jnp.float32)
        return Loss(action_loss(actions, targets, mask), count, jnp.sum(close * mask) / jnp.maximum(count, 1.0))

    def example_inputs(self, batch: int = 1, steps: int = 1) -> dict:
        """A chain of `steps` zero steps: what init needs (also the cache's size with decode)."""
        cfg = self.config
        return {
            "states": jnp.zeros((batch, steps, cfg.obs_dim)),
            "actions": jnp.zeros((batch, steps, cfg.act_dim)),
            **{k: jnp.zeros((batch, steps)) for k in ("rewards", "returns_to_go", "completion")},
            "timestep": jnp.zeros((batch, steps), jnp.int32),
        }

    def linear(self, name: str, x: Array, out: int | None = None) -> Array:
        """x [..., n] @ W [n, out or d_model] + b, in float32 (the inputs and the head are thin)."""
        cfg = self.config
        out = out or cfg.d_model
        axes = ("features", "embed") if out == cfg.d_model else ("embed", "features")
        w = logical_param(self, f"{name}_kernel", (x.shape[-1], out), axes, nn.initializers.normal(0.02))
        b = logical_param(self, f"{name}_bias", (out,), axes[1:], nn.initializers.zeros)
        return jnp.asarray(x, jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)


def action_loss(predicted: Array, actions: Array, mask: Array) -> Array:
    """The mean squared error of the predicted actions over the real steps (mask 1.0)."""
    error = jnp.mean(jnp.square(predicted - actions), axis=-1)
    return jnp.sum(error * mask) / jnp.maximum(jnp.sum(mask), 1.0)
