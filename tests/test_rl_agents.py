"""The RND exploration agent: RND's error falls where the agent has been, the networks learn,
and a collection writes ExoRL episodes and resumes with the agent where it stopped."""

import numpy as np
import pytest

from bpt.rl import exorl
from bpt.rl.agents import RNDAgent, RNDSettings
from bpt.rl.collect import collect, collect_rnd

SMALL = RNDSettings(hidden=32, features=16, batch_size=32, seed_steps=20, learning_rate=1e-3)


def test_rnd_reward_falls_on_visited_states_and_stays_high_elsewhere():
    rng = np.random.RandomState(0)
    agent = RNDAgent(4, 2, SMALL, seed=0)
    seen = rng.normal(size=(32, 4)).astype(np.float32)
    batch = {"obs": seen, "action": rng.uniform(-1, 1, (32, 2)).astype(np.float32), "next_obs": seen,
             "discount": np.ones(32, np.float32)}  # fmt: skip
    agent.update(batch)  # the running statistics see the states once
    before = agent.intrinsic_reward(seen).mean()
    for _ in range(200):
        losses = agent.update(batch)
    assert agent.intrinsic_reward(seen).mean() < 0.2 * before
    unseen = (rng.normal(size=(32, 4)) * 3 + 5).astype(np.float32)
    assert agent.intrinsic_reward(unseen).mean() > 5 * agent.intrinsic_reward(seen).mean()
    assert set(losses) == {"predictor", "critic", "actor", "intrinsic_reward"}
    assert all(np.isfinite(v) for v in losses.values())


def test_rnd_collection_writes_episodes_and_resumes_the_agent(tmp_path):
    paths = collect_rnd("cartpole", 2, tmp_path, time_limit=0.3, settings=SMALL, progress=False)
    assert [p.name for p in paths] == ["rnd_000000_30.npz", "rnd_000001_30.npz"]
    folder = exorl.buffer_dir(tmp_path, "cartpole")
    agent = RNDAgent(5, 1, SMALL)
    agent.load(folder / "rnd_agent.msgpack")
    assert (agent.steps, agent.episodes, int(agent.state["updates"])) == (60, 2, 20)  # every 2nd step after 20 seed steps
    more = collect_rnd("cartpole", 3, tmp_path, time_limit=0.3, settings=SMALL, progress=False)
    assert [p.name for p in more] == ["rnd_000002_30.npz"]
    agent.load(folder / "rnd_agent.msgpack")
    assert (agent.steps, agent.episodes, int(agent.state["updates"])) == (90, 3, 35)
    episode = exorl.load_episode(more[0])
    assert np.abs(episode["action"][1:]).max() <= 1.0 and episode["physics"].shape == (31, 4)
    # Both agents' episodes live side by side and load as one dataset.
    collect("cartpole", 1, tmp_path, time_limit=0.3, progress=False)
    assert len(exorl.episode_files(tmp_path, "cartpole")) == 4
    (folder / "rnd_agent.msgpack").unlink()
    with pytest.raises(FileNotFoundError, match="cannot resume"):
        collect_rnd("cartpole", 4, tmp_path, time_limit=0.3, settings=SMALL, progress=False)
