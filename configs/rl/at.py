"""The Agentic Transformer on ExoRL-format data (the paper's Table 5/6 settings).

    bpt-train --config configs/rl/at.py:walker_walk --config.data.path data/exorl --workdir runs/at4
    bpt-train --config configs/rl/at.py:walker_walk,32 --workdir runs/at32     # 32 trajectories a chain
    bpt-eval-rl --workdir runs/at4 --episodes 10 --trials 4

The argument: TASK[,TRAJECTORIES] (default walker_walk,4); data.seq_len follows (4 tokens a
step, 1000 steps a trajectory).
"""

from bpt.config import agentic_config


def get_config(arg: str = "walker_walk"):
    task, *rest = arg.split(",")
    return agentic_config(task, int(rest[0]) if rest else 4, "at")
