"""The Agentic Transformer on ExoRL-format data (the paper's Table 5/6 settings).

    bpt-train --config configs/rl/at.py:walker_walk --config.data.path data/exorl --workdir runs/at4
    bpt-train --config configs/rl/at.py:walker_walk,32 --workdir runs/at32     # 32 trajectories a chain
    bpt-train --config configs/rl/at.py:walker_walk,4,200 ...   # episodes of 200 steps (--time_limit 5)
    bpt-eval-rl --workdir runs/at4 --episodes 10 --trials 4

The argument: TASK[,TRAJECTORIES[,EPISODE_LENGTH]] (default walker_walk,4 and the suite's 1000
steps); data.seq_len follows (4 tokens a step). configs/rl/at_cpu.py is a run that fits a CPU.
"""

from bpt.config import agentic_config


def get_config(arg: str = "walker_walk"):
    task, *rest = arg.split(",")
    trajectories = int(rest[0]) if rest else 4
    episode_length = int(rest[1]) if len(rest) > 1 else 0
    return agentic_config(task, trajectories, "at", episode_length)
