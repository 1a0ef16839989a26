"""bpt-collect-exorl: reward-free dm_control episodes in ExoRL's layout.

    bpt-collect-exorl --domain walker --episodes 1000 --out data/exorl --num_workers 8
    bpt-collect-exorl --domain cheetah --episodes 200 --out data/exorl --agent rnd

Writes OUT/<domain>/buffer/<agent>_<index>_<length>.npz (bpt.rl.exorl). Run it again after an
interruption, or with more --episodes, and it collects only the episodes not yet on disk.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from absl import flags

from bpt.cli import common


def define_flags() -> SimpleNamespace:
    from bpt.rl.collect import AGENTS

    return SimpleNamespace(
        domain=flags.DEFINE_string(
            "domain",
            None,
            "A dm_control suite domain (walker, cheetah, cartpole, ...) or jaco (bpt.rl.jaco).",
            required=True,
        ),
        episodes=flags.DEFINE_integer(
            "episodes", 100, "Episodes of the agent in all (those on disk count).", lower_bound=1
        ),
        out=flags.DEFINE_string("out", None, "The dataset folder (ExoRL's datasets/ level).", required=True),
        agent=flags.DEFINE_enum("agent", "random", AGENTS, "The exploration agent."),
        workers=flags.DEFINE_integer("num_workers", 1, "Worker processes.", lower_bound=1),
        seed=flags.DEFINE_integer("seed", 0, "Episode i is seeded from (seed, i)."),
        time_limit=flags.DEFINE_float(
            "time_limit", None, "Seconds an episode lasts (default: the task's own, 1000 steps)."
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    from bpt.rl import exorl
    from bpt.rl.collect import collect, collected

    before = len(collected(f.out.value, f.domain.value, f.agent.value))
    written = collect(
        f.domain.value,
        f.episodes.value,
        f.out.value,
        agent=f.agent.value,
        workers=f.workers.value,
        seed=f.seed.value,
        time_limit=f.time_limit.value,
    )
    folder = exorl.buffer_dir(f.out.value, f.domain.value)
    print(f"{folder}: {len(written)} episodes written, {before} were there already")


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
