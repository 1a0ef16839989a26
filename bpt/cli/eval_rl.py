"""bpt-eval-rl: rollouts of a trained Agentic Transformer (or DT, BC) run in dm_control.

    bpt-eval-rl --workdir runs/at4 --episodes 10 --trials 4
    bpt-eval-rl --workdir runs/at4 --episodes 10 --trials 16 --target_return 900

Each of --episodes environments plays --trials trials in one context, conditioned on
--target_return (default: the best return among the run's training trajectories) and on its
own earlier trials. By default each finished trial's completion flag is relabeled by its
return before the next trial, as the training chains are labeled (bpt.rl.evaluate): the
protocol that matches training; the mean and std of the returns by trial go to
WORKDIR/eval_rl_hindsight.json. --nohindsight plays the trials as they come (the context
keeps each trial's flags as played) and writes WORKDIR/eval_rl.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from absl import flags

from bpt.cli import common


def define_flags() -> SimpleNamespace:
    return SimpleNamespace(
        workdir=flags.DEFINE_string("workdir", None, "A bpt-train run of model.family=agentic.", required=True),
        episodes=flags.DEFINE_integer("episodes", 10, "Environments, each one row of the batch.", lower_bound=1),
        trials=flags.DEFINE_integer("trials", 1, "Trials each environment plays in one context.", lower_bound=1),
        target_return=flags.DEFINE_float("target_return", None, "The return asked for (default: the best in the data)."),
        seed=flags.DEFINE_integer("seed", 0, "Environment i is seeded with seed + i."),
        hindsight=flags.DEFINE_boolean(
            "hindsight",
            True,
            "Relabel finished trials' completion flags by their returns, as the training chains are "
            "(--nohindsight: as played).",
        ),
    )


def main(f: SimpleNamespace, argv: list[str]) -> None:
    import numpy as np

    from bpt.rl.evaluate import rollout
    from bpt.train.loop import restore_run, say

    config, dataset, model, state = restore_run(f.workdir.value)
    if config.model.family != "agentic":
        raise ValueError(f"{f.workdir.value} is a model.family={config.model.family!r} run; bpt-eval-rl takes agentic runs")
    target = f.target_return.value
    if target is None:
        target = float(dataset.returns.max())
    say(f"{config.data.task}: {f.episodes.value} episodes x {f.trials.value} trials, target return {target:.1f}")
    out = rollout(
        model,
        state.params,
        config.data.task,
        episodes=f.episodes.value,
        trials=f.trials.value,
        target_return=target,
        seed=f.seed.value,
        episode_length=config.data.episode_length,
        hindsight=f.hindsight.value,
    )
    returns = out["returns"]
    result = {
        "task": config.data.task,
        "step": int(state.step),
        "target_return": target,
        "episodes": f.episodes.value,
        "trials": f.trials.value,
        "hindsight": f.hindsight.value,
        "mean_by_trial": returns.mean(axis=0).tolist(),
        "std_by_trial": returns.std(axis=0).tolist(),
        "returns": returns.tolist(),
    }
    for trial, (mean, std) in enumerate(zip(result["mean_by_trial"], result["std_by_trial"])):
        print(f"trial {trial + 1}: return {mean:.1f} +- {std:.1f}")
    best = returns.max(axis=1)
    print(f"best trial per episode: {best.mean():.1f} +- {best.std():.1f}")
    result["best_mean"], result["best_std"] = float(np.mean(best)), float(np.std(best))
    path = Path(f.workdir.value) / ("eval_rl_hindsight.json" if f.hindsight.value else "eval_rl.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"written to {path}")


def run() -> None:
    common.run_command(sys.modules[__name__])


if __name__ == "__main__":
    run()
