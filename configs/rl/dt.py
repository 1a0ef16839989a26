"""Decision Transformer: the Agentic Transformer's model on chains of one trajectory.

    bpt-train --config configs/rl/dt.py:walker_walk --config.data.path data/exorl --workdir runs/dt
"""

from bpt.config import agentic_config


def get_config(task: str = "walker_walk"):
    return agentic_config(task, 1, "dt")
