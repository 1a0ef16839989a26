"""ExoRL-format data: relabeling against dm_control's online rewards, the file layout and its
round trip, resumable collection, and the Agentic Transformer's chains of trajectories."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from bpt.rl import collect, exorl
from bpt.rl.sequences import Trajectory, best_fraction, chain, sample_chains, trajectory


def online_episode(task: str, steps: int, seed: int = 0):
    """steps of random actions from a reset, as ExoRL's rows, with dm_control's own float64
    rewards (the values relabel must give back exactly)."""
    domain, name = exorl.split_task(task)
    env = exorl.make_env(domain, name, seed=seed)
    rng = np.random.RandomState(seed)
    spec = env.action_spec()
    step = env.reset()
    rows = {"observation": [exorl.flatten_observation(step.observation)], "action": [np.zeros(spec.shape)],
            "physics": [env.physics.get_state().copy()]}  # fmt: skip
    online = [np.nan]
    for _ in range(steps):
        action = rng.uniform(spec.minimum, spec.maximum, spec.shape)
        step = env.step(action)
        rows["observation"].append(exorl.flatten_observation(step.observation))
        rows["action"].append(action)
        rows["physics"].append(env.physics.get_state().copy())
        online.append(step.reward)
    episode = {k: np.stack(v) for k, v in rows.items()}
    episode["reward"] = np.zeros((steps + 1, 1), np.float32)
    episode["discount"] = np.ones((steps + 1, 1), np.float32)
    return episode, np.array(online)


@pytest.mark.parametrize("task", ["walker_walk", "cheetah_run", "cartpole_swingup"])
def test_relabel_gives_dm_controls_online_rewards_bit_for_bit(task):
    episode, online = online_episode(task, steps=60)
    rewards = exorl.relabel(episode, task)
    assert rewards.shape == (61, 1) and rewards.dtype == np.float64
    np.testing.assert_array_equal(rewards[1:, 0], online[1:])
    if task == "cartpole_swingup":  # its reward reads the control: the state alone is not enough
        without_control = exorl.relabel(dict(episode, action=np.zeros_like(episode["action"])), task)
        assert not np.array_equal(without_control[1:, 0], online[1:])


def test_jaco_reach_the_papers_sixth_task_relabels_exactly_for_its_four_targets(tmp_path):
    """bpt.rl.jaco: dm_control's Jaco arm reaching a fixed target, 250 steps an episode; one
    dataset relabels for the four corners (the target is not observed), bit for bit."""
    episode, online = online_episode("jaco_reach_top_left", steps=40, seed=3)
    assert episode["observation"].shape == (41, 42) and episode["action"].shape == (41, 9)
    np.testing.assert_array_equal(exorl.relabel(episode, "jaco_reach_top_left")[1:, 0], online[1:])
    assert online[1:].max() > 0.01  # the shaped reward has a signal away from the target
    others = [exorl.relabel(episode, f"jaco_{name}")[1:, 0] for name in exorl.JACO_TASKS[1:]]
    assert not any(np.array_equal(r, online[1:]) for r in others)
    env = exorl.make_env("jaco")
    assert exorl.episode_steps(env) == 250 and exorl.episode_steps(exorl.make_env("cartpole")) == 1000
    # Collection seeds jaco's initial state per episode (a composer environment's random state).
    paths = collect.collect("jaco", 2, tmp_path, time_limit=0.4, progress=False)
    assert [p.name for p in paths] == ["random_000000_10.npz", "random_000001_10.npz"]
    first = exorl.load_episode(paths[0])["physics"][0]
    paths[0].unlink()
    collect.collect("jaco", 2, tmp_path, time_limit=0.4, progress=False)
    np.testing.assert_array_equal(exorl.load_episode(paths[0])["physics"][0], first)
    assert not np.array_equal(exorl.load_episode(paths[1])["physics"][0], first)
    with pytest.raises(ValueError, match="jaco task must be one of reach_top_left"):
        exorl.make_env("jaco", "reach_middle")


def test_collection_writes_exorls_layout_and_resumes(tmp_path):
    paths = collect.collect("cartpole", 2, tmp_path, progress=False)
    assert [p.name for p in paths] == ["random_000000_1000.npz", "random_000001_1000.npz"]
    assert all(p.parent == tmp_path / "cartpole" / "buffer" for p in paths)
    episode = exorl.load_episode(paths[1])
    assert set(episode) == set(exorl.KEYS)
    assert {k: v.shape for k, v in episode.items()} == {
        "observation": (1001, 5), "action": (1001, 1), "reward": (1001, 1), "discount": (1001, 1), "physics": (1001, 4),
    }  # fmt: skip
    assert not episode["action"][0].any() and episode["reward"][0, 0] == 0.0  # the reset row
    assert np.abs(episode["action"]).max() <= 1.0
    # The stored reward is the collecting task's (cartpole swingup): relabel gives it back.
    np.testing.assert_allclose(
        exorl.relabel(episode, "cartpole_swingup")[1:], episode["reward"][1:], rtol=1e-6
    )
    # Interrupted: one episode lost, a half-written file left behind. A rerun writes only the
    # missing one, the same bytes as before (episode i is seeded from (seed, i) alone).
    before = paths[1].read_bytes()
    paths[1].unlink()
    (paths[1].parent / (paths[1].name + ".partial")).write_bytes(b"half")
    again = collect.collect("cartpole", 3, tmp_path, progress=False)
    assert [p.name for p in again] == ["random_000001_1000.npz", "random_000002_1000.npz"]
    assert np.array_equal(
        exorl.load_episode(paths[1])["observation"], np.load(io.BytesIO(before))["observation"]
    )
    assert collect.collected(tmp_path, "cartpole", "random") == {0, 1, 2}
    # Each episode starts from its own random state.
    assert not np.array_equal(exorl.load_episode(again[1])["physics"][0], episode["physics"][0])


def test_episode_files_reads_exorls_nested_layout(tmp_path):
    episode, _ = online_episode("walker_walk", steps=3)
    nested = tmp_path / "datasets" / "walker" / "rnd" / "buffer" / "episode_000007_3.npz"
    exorl.save_episode(nested, episode)
    assert exorl.episode_files(tmp_path / "datasets", "walker") == [nested]
    assert exorl.load_episode(nested)["physics"].dtype == np.float64
    with pytest.raises(FileNotFoundError, match="no episodes"):
        exorl.episode_files(tmp_path / "datasets", "cheetah")
    with pytest.raises(ValueError, match="missing discount"):
        exorl.save_episode(tmp_path / "bad_1.npz", {k: v for k, v in episode.items() if k != "discount"})
    with pytest.raises(ValueError, match="task must be a dm_control suite or jaco task"):
        exorl.relabel(episode, "walker_fly")
    with pytest.raises(ValueError, match="another domain"):
        exorl.relabel(episode, "cartpole_swingup")


def make_trajectory(rewards, obs_dim=3, act_dim=2, seed=0):
    rng = np.random.default_rng(seed)
    steps = len(rewards)
    return Trajectory(
        rng.normal(size=(steps, obs_dim)).astype(np.float32),
        rng.uniform(-1, 1, (steps, act_dim)).astype(np.float32),
        np.asarray(rewards, np.float32),
    )


def test_a_chain_sorts_by_return_and_relabels_to_the_best():
    worst, best, middle = (
        make_trajectory([0, 1, 0]),
        make_trajectory([2, 2, 2]),
        make_trajectory([1, 1], seed=1),
    )
    c = chain([best, worst, middle])
    assert c["states"].shape == (9, 3) and c["actions"].shape == (9, 2)
    np.testing.assert_array_equal(c["trajectory"], [0, 0, 0, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(c["timestep"], [0, 1, 2] * 3)
    np.testing.assert_array_equal(c["rewards"], [0, 1, 0, 1, 1, 0, 2, 2, 2])  # ascending returns 1, 2, 6
    np.testing.assert_array_equal(c["mask"], [1, 1, 1, 1, 1, 0, 1, 1, 1])  # the 2-step one padded
    # Returns-to-go to the target 6: what is left of it before each step.
    np.testing.assert_array_equal(c["returns_to_go"], [6, 6, 5, 6, 5, 0, 6, 4, 2])
    np.testing.assert_array_equal(c["completion"], [0, 0, 0, 0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(c["states"][6:9], best.states)
    # Decision Transformer: a chain of one, its own return the target.
    one = chain([middle])
    np.testing.assert_array_equal(one["returns_to_go"], [2, 1])
    np.testing.assert_array_equal(one["completion"], [1, 1])


def test_trajectories_from_episodes_and_the_bc_filter():
    episode, online = online_episode("cheetah_run", steps=5)
    t = trajectory(episode, exorl.relabel(episode, "cheetah_run"))
    np.testing.assert_array_equal(t.states, episode["observation"][:5])  # s_t: the row before the step
    np.testing.assert_array_equal(t.actions, episode["action"][1:].astype(np.float32))  # a_t: taken in s_t
    np.testing.assert_array_equal(t.rewards, online[1:].astype(np.float32))  # r_t: what followed
    pool = [make_trajectory([r]) for r in range(20)]
    assert [t.total for t in best_fraction(pool, 0.1)] == [19.0, 18.0]
    assert len(best_fraction(pool[:3], 0.1)) == 1
    with pytest.raises(ValueError, match="fraction must be in"):
        best_fraction(pool, 0.0)


def test_sampled_chains_hold_distinct_trajectories():
    pool = [make_trajectory([float(i)] * (2 + i % 3), seed=i) for i in range(10)]
    batch = sample_chains(pool, num_trajectories=4, batch_size=3, rng=np.random.default_rng(1))
    assert batch["states"].shape == (3, 16, 3) and batch["returns_to_go"].shape == (3, 16)
    for row in range(3):
        totals = [float(batch["rewards"][row][batch["trajectory"][row] == i].sum()) for i in range(4)]
        firsts = {batch["states"][row][(batch["trajectory"][row] == i)][0].tobytes() for i in range(4)}
        assert totals == sorted(totals) and len(firsts) == 4  # four distinct trajectories, ascending
    with pytest.raises(ValueError, match="num_trajectories must be >= 1"):
        sample_chains(pool, num_trajectories=0, batch_size=1, rng=np.random.default_rng(0))
    # A pool smaller than a chain (a held-out split) is drawn with replacement; rows: a part.
    small = sample_chains(pool[:2], num_trajectories=4, batch_size=4, rng=np.random.default_rng(0), rows=slice(2, 4))
    assert small["states"].shape == (2, 4 * 3, 3)  # four trajectories of the longest, 3 steps


def test_the_collect_command(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "bpt.cli.collect_exorl", *args], capture_output=True, text=True, env=env
    )
    done = run("--domain", "cartpole", "--episodes", "2", "--num_workers", "2", "--time_limit", "0.2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "2 episodes written, 0 were there already" in done.stdout
    assert [p.name for p in exorl.episode_files(tmp_path, "cartpole")] == ["random_000000_20.npz", "random_000001_20.npz"]
    bad = run("--domain", "walkr", "--out", str(tmp_path))
    assert bad.returncode == 1 and "domain must be a dm_control suite domain" in bad.stderr


def test_episodes_without_physics_load_from_the_relabeled_cache(tmp_path):
    """Once a task's rewards are cached, the physics states can be dropped (a smaller copy to
    train from, as scripts/rl_returns.py packs it); without the cache they are needed."""
    from bpt.rl.data import relabeled

    collect.collect("cartpole", 2, tmp_path, time_limit=0.1, progress=False)
    first = relabeled(tmp_path, "cartpole_swingup", progress=False)
    for path in exorl.episode_files(tmp_path, "cartpole"):
        episode = exorl.load_episode(path)
        np.savez(path, **{k: v for k, v in episode.items() if k != "physics"})
    again = relabeled(tmp_path, "cartpole_swingup", progress=False)
    assert [n for n, _ in again] == [n for n, _ in first]
    for (_, a), (_, b) in zip(first, again):
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_array_equal(a.states, b.states)
    with pytest.raises(ValueError, match="relabel needs the episode's physics states"):
        relabeled(tmp_path, "cartpole_balance", progress=False)
