"""BC-10%: behaviour cloning of the best 10% of the trajectories by return (one trajectory a
sequence; the model reads states and actions, no returns or rewards).

    bpt-train --config configs/rl/bc.py:walker_walk --config.data.path data/exorl --workdir runs/bc
"""

from bpt.config import agentic_config


def get_config(task: str = "walker_walk"):
    return agentic_config(task, 1, "bc")
