"""Notebook 09's exercises: sequence parallelism's collectives, the online-softmax merge of ring
attention, and the permutation that sends each token to its expert's rank.

One submodule per parallelism, each beside the implementation it grades
(:mod:`labkit.parallel.sequence`, :mod:`labkit.parallel.context`, :mod:`labkit.parallel.expert`);
the notebook imports this package::

    from labkit.exercises import sequence_context_expert as exercise
    exercise.online_softmax_merge(my_merge)
"""

from .context import *  # noqa: F403
from .expert import *  # noqa: F403
from .sequence import *  # noqa: F403
