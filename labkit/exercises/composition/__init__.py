"""Notebook 10's exercises: ZeRO-1's step, the interleaved 1F1B order, a layout's memory.

One submodule per topic, each beside what it grades (:mod:`labkit.parallel.zero`,
:mod:`labkit.parallel.schedules`, :mod:`labkit.planner`); the notebook imports this package::

    from labkit.exercises import composition as exercise
    exercise.zero1_step(my_zero1_step)
"""

from .planner import *  # noqa: F403
from .schedules import *  # noqa: F403
from .zero import *  # noqa: F403
