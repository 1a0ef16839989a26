"""The Agentic Transformer in minutes on a CPU: short episodes, two a chain, a small batch.

    bpt-collect-exorl --domain walker --episodes 100 --time_limit 2.5 --out data/exorl_small
    bpt-train --config configs/rl/at_cpu.py --config.data.path=data/exorl_small --workdir runs/at_cpu
    bpt-eval-rl --workdir runs/at_cpu --episodes 2 --trials 2

The argument: TASK[,TRAJECTORIES[,EPISODE_LENGTH]] as configs/rl/at.py's (default
walker_walk,2,100: --time_limit 2.5 makes walker episodes of 100 steps). The paper's model
(3 layers, width 128) on 800-token chains, 200 steps of 8 chains (about two minutes on two
CPU cores); a check that the pipeline works and the action loss falls, not the paper's
result (configs/rl/at.py).
"""

from bpt.config import agentic_config


def get_config(arg: str = "walker_walk,2,100"):
    task, *rest = arg.split(",")
    trajectories = int(rest[0]) if rest else 2
    episode_length = int(rest[1]) if len(rest) > 1 else 100
    c = agentic_config(task, trajectories, "at", episode_length)
    c.model.q_chunk_size = c.model.kv_chunk_size = c.model.loss_chunk_size = 200
    c.train.update(steps=200, batch_size=8, learning_rate=1e-3, warmup_steps=20)
    c.train.update(eval_every=100, eval_batches=2, checkpoint_every=100, log_every=10)
    return c
