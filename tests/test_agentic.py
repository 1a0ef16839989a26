"""The Agentic Transformer on bpt's GPT layers: the three attention modes agree, causality
over the chain's tokens, the action loss falls, and the memory of a training step at 4 and 32
trajectories a chain (vanilla grows with the square of the chain, BPT linearly)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rel_err

from bpt.models.agentic import AgenticConfig, AgenticTransformer, action_loss
from bpt.rl.sequences import Trajectory, chain, sample_chains

OBS, ACT, STEPS = 3, 2, 8
W = np.random.default_rng(123).normal(size=(OBS, ACT))


def config(mode="blockwise_parallel", **changes):
    base = dict(vocab_size=1, num_layers=2, d_model=32, num_heads=2, obs_dim=OBS, act_dim=ACT, max_timestep=STEPS,
                mlp_activation="relu", attention_mode=mode, q_chunk_size=16, kv_chunk_size=16, loss_chunk_size=16)  # fmt: skip
    return AgenticConfig(**(base | changes))


def pool(seed, count=12, steps=STEPS):
    """Trajectories whose actions are a fixed function of their states (learnable)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        states = rng.normal(size=(steps, OBS)).astype(np.float32)
        out.append(
            Trajectory(
                states, np.tanh(states @ W).astype(np.float32), rng.uniform(0, 1, steps).astype(np.float32)
            )
        )
    return out


def loss_fn(model):
    return lambda params, batch: action_loss(
        model.apply({"params": params}, batch), batch["actions"], batch["mask"]
    )


def test_the_three_attention_modes_agree_values_and_gradients(key):
    batch = sample_chains(pool(int(key[1])), 2, 3, np.random.default_rng(int(key[0])))
    params = nn.meta.unbox(AgenticTransformer(config("vanilla")).init(key, batch)["params"])
    results = {}
    for mode in ("vanilla", "memory_efficient", "blockwise_parallel"):
        model = AgenticTransformer(config(mode))
        out = jax.jit(model.apply)({"params": params}, batch)
        grads = jax.jit(jax.grad(loss_fn(model)))(params, batch)
        results[mode] = out, grads
    assert results["vanilla"][0].shape == (3, 2 * STEPS, ACT)
    for mode in ("memory_efficient", "blockwise_parallel"):
        assert rel_err(results[mode][0], results["vanilla"][0]) < 1e-5, mode
        for a, b in zip(jax.tree.leaves(results[mode][1]), jax.tree.leaves(results["vanilla"][1])):
            assert rel_err(a, b) < 1e-5, mode


def test_an_action_is_predicted_from_what_came_before_it(key):
    """The prediction at step t reads step t's return-to-go and state and everything before,
    never step t's own action, reward or anything later."""
    c = {k: jnp.asarray(v[None]) for k, v in chain(pool(int(key[1]), count=2)).items()}
    model = AgenticTransformer(config())
    params = model.init(key, c)["params"]
    apply = jax.jit(model.apply)
    base = apply({"params": params}, c)
    t = 5
    for name in ("actions", "rewards"):
        changed = dict(c, **{name: c[name].at[:, t:].add(0.7)})  # step t's on
        out = apply({"params": params}, changed)
        np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])
        assert not np.array_equal(out[:, t + 1 :], base[:, t + 1 :])
    for name in ("states", "returns_to_go"):
        changed = dict(c, **{name: c[name].at[:, t].add(5000.0)})  # returns are scaled by 1e-3
        out = apply({"params": params}, changed)
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        # read at step t: any change there (a deterministic program; how much depends on the
        # random weights: 6e-5 with seed 553256125)
        assert not np.array_equal(out[:, t], base[:, t]), name


def test_the_action_loss_falls():
    model = AgenticTransformer(config(dropout=0.1))
    rng, train_pool = np.random.default_rng(1), pool(0)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), sample_chains(train_pool, 2, 8, rng))["params"])
    optimizer = optax.adamw(1e-3, weight_decay=1e-4)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch, rng):
        def loss(p):
            out = model.apply({"params": p}, batch, deterministic=False, rngs={"dropout": rng})
            return action_loss(out, batch["actions"], batch["mask"])

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for i in range(100):
        params, state, value = step(params, state, sample_chains(train_pool, 2, 8, rng), jax.random.PRNGKey(i))
        losses.append(float(value))
    held_out = sample_chains(pool(99), 2, 8, np.random.default_rng(0))
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:5])
    assert float(loss_fn(model)(params, held_out)) < 0.2 * np.mean(losses[:5])  # it learned s -> a


def test_training_memory_at_4_and_32_trajectories():
    """The compiled training step's temporary memory: vanilla materializes [tokens, tokens]
    scores (x64 for 8x the trajectories at this size: over 20x), BPT stays linear (under 10x)."""
    steps = 32

    def temp_bytes(mode, trajectories):
        model = AgenticTransformer(
            config(mode, max_timestep=steps, q_chunk_size=64, kv_chunk_size=64, num_heads=1)
        )
        batch = jax.tree.map(lambda x: x[None], chain(pool(0, count=trajectories, steps=steps)))
        params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch)["params"]))
        grad = jax.jit(jax.grad(loss_fn(model)))
        return grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    ratios = {mode: temp_bytes(mode, 32) / temp_bytes(mode, 4) for mode in ("vanilla", "blockwise_parallel")}
    assert ratios["vanilla"] > 20, ratios
    assert ratios["blockwise_parallel"] < 10, ratios


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="model.obs_dim must be a positive integer"):
        config(obs_dim=0)
    with pytest.raises(ValueError, match="unknown model.mlp_activation 'tanh'"):
        config(mlp_activation="tanh")
    model = AgenticTransformer(config())
    with pytest.raises(ValueError, match="missing timestep"):
        c = {k: v[None] for k, v in chain(pool(0, count=1)).items() if k != "timestep"}
        model.init(jax.random.PRNGKey(0), c)


def test_a_rollout_with_the_cache_acts_as_the_full_forward_predicts():
    """Two cartpole episodes of 20 steps, two trials each in one context: every action taken
    through the cache equals the full forward's prediction over the chain that was fed."""
    from bpt.rl import exorl
    from bpt.rl.evaluate import rollout

    obs = exorl.flatten_observation(exorl.make_env("cartpole").reset().observation).shape[0]
    model = AgenticTransformer(
        config(obs_dim=obs, act_dim=1, max_timestep=20, q_chunk_size=8, kv_chunk_size=8)
    )
    c = {k: jnp.asarray(v[None]) for k, v in chain([Trajectory(np.zeros((4, obs), np.float32), np.zeros((4, 1), np.float32), np.zeros(4, np.float32))]).items()}  # fmt: skip
    params = model.init(jax.random.PRNGKey(0), c)["params"]
    out = rollout(
        model,
        params,
        "cartpole_swingup",
        episodes=2,
        trials=2,
        target_return=20.0,
        time_limit=0.2,
        progress=False,
    )
    assert out["returns"].shape == (2, 2) and out["actions"].shape == (2, 40, 1)
    np.testing.assert_allclose(out["returns"], out["rewards"].reshape(2, 2, 20).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(out["timestep"][0], np.tile(np.arange(20), 2))
    full = model.apply({"params": params}, {k: v for k, v in out.items() if k != "returns"})
    np.testing.assert_allclose(np.asarray(full), out["actions"], atol=1e-5)
    assert np.abs(out["actions"]).max() > 0  # it acted (and differently per episode)
    assert not np.array_equal(out["actions"][0], out["actions"][1])
    # hindsight: trial 1 (short of the target) is relabeled to completion 0 and its cache
    # recomputed, so trial 2 acts as the full forward over the relabeled chain predicts, and
    # trial 1 as it did over the chain as played
    kwargs = dict(episodes=2, trials=2, target_return=20.0, time_limit=0.2, progress=False)
    out = rollout(model, params, "cartpole_swingup", hindsight=True, **kwargs)
    assert np.all(out["returns"][:, 0] < 20.0)
    np.testing.assert_array_equal(out["completion"], np.repeat([[0.0] * 20 + [1.0] * 20], 2, axis=0))
    fed = {k: v for k, v in out.items() if k != "returns"}
    relabeled = np.asarray(model.apply({"params": params}, fed))
    played = np.asarray(model.apply({"params": params}, {**fed, "completion": np.ones_like(out["completion"])}))
    np.testing.assert_allclose(relabeled[:, 20:], out["actions"][:, 20:], atol=1e-5)
    np.testing.assert_allclose(played[:, :20], out["actions"][:, :20], atol=1e-5)
    assert np.abs(relabeled[:, 20:] - played[:, 20:]).max() > 1e-4  # the flag changed what trial 2 saw


def test_bpt_train_and_bpt_eval_rl_on_collected_episodes(tmp_path):
    """The whole path on a CPU: collect 25-step cartpole episodes, train AT on chains of two
    through bpt-train (configs/rl/at.py), resume it, evaluate it by rollouts (bpt-eval-rl)."""
    import json
    import subprocess
    import sys

    from bpt.config import load_config_file, override
    from bpt.rl.collect import collect
    from bpt.train.loop import train

    collect("cartpole", 8, tmp_path / "exorl", time_limit=0.25, progress=False)
    c = override(
        load_config_file("configs/rl/at.py:cartpole_swingup,2,25"),  # episodes of 25 steps
        f"data.path={tmp_path / 'exorl'}", "model.q_chunk_size=50", "model.kv_chunk_size=50", "model.loss_chunk_size=50", "train.steps=20",
        "train.batch_size=4", "train.eval_every=10", "train.eval_batches=1", "train.checkpoint_every=10",
        "train.log_every=10", "train.warmup_steps=2", "train.learning_rate=1e-3",
    )  # fmt: skip
    last = train(c, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20]
    assert records[-1]["loss"] < records[0]["loss"] and "eval_loss" in last and "eval_perplexity" not in last
    assert (tmp_path / "exorl" / "cartpole" / "relabeled_cartpole_swingup.npz").is_file()  # cached
    for extra, name in ((["--nohindsight"], "eval_rl.json"), ([], "eval_rl_hindsight.json")):
        result = subprocess.run(
            [sys.executable, "-m", "bpt.cli.eval_rl", "--workdir", str(tmp_path / "run"), "--episodes", "2",
             "--trials", "2", *extra],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        assert "trial 2: return" in result.stdout
        saved = json.loads((tmp_path / "run" / name).read_text())
        assert saved["step"] == 20 and len(saved["returns"]) == 2 and len(saved["returns"][0]) == 2
        assert saved["hindsight"] == (not extra)  # relabeled in hindsight by default, as training


@pytest.mark.parametrize(
    "change,message",
    [
        ({"model.family": "gpt"}, "data.name='exorl' goes with model.family='agentic'"),
        ({"data.seq_len": 100}, r"data.seq_len must be 4 x data.trajectories x data.episode_length = 200"),
        ({"data.trajectories": 9, "data.seq_len": 900}, "data.trajectories=9 is more than the 7 training trajectories"),
        ({"data.best_fraction": 0.0}, r"data.best_fraction must be in \(0, 1\]"),
    ],
)
def test_rl_settings_are_checked(tmp_path, change, message):
    from bpt.config import check_config, load_config_file
    from bpt.rl.collect import collect
    from bpt.train.loop import setup

    collect("cartpole", 8, tmp_path, time_limit=0.25, progress=False)
    c = load_config_file("configs/rl/at.py:cartpole_swingup,2")
    c.data.update(path=str(tmp_path), episode_length=25, seq_len=200)
    c.model.update(q_chunk_size=50, kv_chunk_size=50, loss_chunk_size=50)
    for key, value in change.items():
        section, name = key.split(".")
        c[section][name] = value
    with pytest.raises(ValueError, match=message):
        check_config(c)
        setup(c)


def test_jaco_configs_follow_its_episode_length():
    """configs/rl/{at,dt}.py for a jaco task: 250 steps a trajectory, so AT(32) chains 32,000 tokens."""
    from bpt.config import check_config, load_config_file

    at32 = load_config_file("configs/rl/at.py:jaco_reach_top_left,32")
    assert (at32.data.episode_length, at32.data.seq_len, at32.data.task) == (250, 32000, "jaco_reach_top_left")
    dt = load_config_file("configs/rl/dt.py:jaco_reach_bottom_right")
    assert (dt.data.episode_length, dt.data.seq_len) == (250, 1000)
    check_config(at32)
    assert load_config_file("configs/rl/at.py:walker_walk,32").data.seq_len == 128000


def test_episodes_shorter_than_the_configs_are_padded_and_the_data_says_so(tmp_path, capsys):
    from bpt.config import load_config_file
    from bpt.rl.collect import collect
    from bpt.rl.data import ExoRLDataset

    collect("cartpole", 4, tmp_path / "exorl", time_limit=0.25, progress=False)  # 25 steps
    c = load_config_file("configs/rl/at.py:cartpole_swingup,2,50")
    assert (c.data.episode_length, c.data.seq_len) == (50, 4 * 2 * 50)
    c.data.path = str(tmp_path / "exorl")
    ExoRLDataset(c.data, 0)
    out = capsys.readouterr().out
    assert "have at most 25 steps; each trajectory is padded to data.episode_length=50" in out
    assert "configs/rl/at.py:cartpole_swingup,2,25" in out
    cpu = load_config_file("configs/rl/at_cpu.py")
    assert (cpu.data.episode_length, cpu.data.seq_len, cpu.train.steps) == (100, 800, 200)
