"""Jaco reach: the paper's sixth task, rebuilt on dm_control's manipulation suite.

URLB (and ExoRL after it) added a Kinova Jaco arm that reaches for a fixed point: one
domain, "jaco", whose reward-free data is relabeled for four tasks that differ only in where
the target is. dm_control ships the arm, the hand and the arena but not these tasks, so bpt
builds them from those parts:

- the arm (6 velocity-controlled joints) and its three-fingered hand (3 more actuators:
  9 actions in [-0.63, 0.63] rad/s for the arm's large joints, +-0.84 for the small ones,
  +-5 for the fingers), mounted as in dm_control's manipulation tasks, on its standard arena;
- observations: the arm's and the hand's proprioception as dm_control's manipulation tasks
  give it with features (joint angles as sin and cos, velocities, torques, the pinch site's
  position and orientation). The target is not observed: it is fixed by the task, and one
  dataset serves the four tasks;
- each episode starts with the hand at a uniform point of the box the manipulation suite's
  site-reaching task uses (x, y in [-0.2, 0.2], z in [0.02, 0.4]), pointing down, fingers
  at a uniform grasp;
- reward: dm_control's tolerance of the distance from the pinch site to the target: 1 within
  5 cm, then a Gaussian falling to 0.1 at 20 cm further (the manipulation suite's reach
  reward falls within 5 cm: too sparse for reward-free data to carry a signal; a random
  policy's returns are then 0-120 of 250), so a return lies in [0, steps];
- an episode lasts 10 s at the manipulation suite's control step of 0.04 s: 250 steps.

The four targets are near the corners of that box's upper part (x, y = +-0.15, z = 0.35):
"top" is the side away from the arm's base (y < 0), "left" is x < 0. These are bpt's choices; URLB's exact target coordinates and episode
length are not reproduced, so returns are comparable across bpt's methods, not with
URLB/ExoRL's published jaco numbers.
"""

from __future__ import annotations

import numpy as np

CONTROL_TIMESTEP = 0.04
TIME_LIMIT = 10.0  # seconds
EPISODE_STEPS = round(TIME_LIMIT / CONTROL_TIMESTEP)  # 250: what data.episode_length must be
TARGET_RADIUS = 0.05
MARGIN = 0.2  # the reward falls to 0.1 this far past the target radius
# Targets in the arena's frame (the arm's base is at y = 0.4, dm_control's ARM_OFFSET).
TARGETS = {
    "reach_top_left": (-0.15, -0.15, 0.35),
    "reach_top_right": (0.15, -0.15, 0.35),
    "reach_bottom_left": (-0.15, 0.15, 0.35),
    "reach_bottom_right": (0.15, 0.15, 0.35),
}
_HAND_BOX = ((-0.2, -0.2, 0.02), (0.2, 0.2, 0.4))


def make(task: str, seed: int = 0, time_limit: float | None = None):
    """The composer environment of a jaco task (one of TARGETS), seeded."""
    from dm_control import composer
    from dm_control.composer import initializers
    from dm_control.composer.variation import distributions
    from dm_control.manipulation.shared import arenas, observations, robots, workspaces
    from dm_control.utils import rewards

    if task not in TARGETS:
        raise ValueError(f"jaco task must be one of {', '.join(TARGETS)}; got {task!r}")

    class Reach(composer.Task):
        def __init__(self):
            settings = observations.PERFECT_FEATURES
            self._arena = arenas.Standard()
            self._arm, self._hand = robots.make_arm(settings), robots.make_hand(settings)
            self._arm.attach(self._hand)
            self._arena.attach_offset(self._arm, offset=robots.ARM_OFFSET)
            self._target = workspaces.add_target_site(
                body=self._arena.mjcf_model.worldbody, radius=TARGET_RADIUS, visible=False,
                rgba=(1, 0, 0, 0.3), name="target", pos=TARGETS[task],
            )  # fmt: skip
            self._place_hand = initializers.ToolCenterPointInitializer(
                self._hand, self._arm, position=distributions.Uniform(*_HAND_BOX),
                quaternion=workspaces.DOWN_QUATERNION,
            )  # fmt: skip
            self.control_timestep = CONTROL_TIMESTEP

        @property
        def root_entity(self):
            return self._arena

        def initialize_episode(self, physics, random_state):
            self._hand.set_grasp(physics, close_factors=random_state.uniform())
            self._place_hand(physics, random_state)

        def get_reward(self, physics):
            hand = physics.bind(self._hand.tool_center_point).xpos
            distance = np.linalg.norm(hand - physics.bind(self._target).xpos)
            return rewards.tolerance(distance, bounds=(0, TARGET_RADIUS), margin=MARGIN)

    return composer.Environment(
        Reach(),
        time_limit=TIME_LIMIT if time_limit is None else time_limit,
        random_state=seed,
        strip_singleton_obs_buffer_dim=True,
    )
