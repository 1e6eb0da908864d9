"""Figures: every plot the notebooks show, drawn from plain result rows. Nothing here measures.

One module per notebook or concern, each readable in a sitting; every figure is also a name of
this package (``labkit.plots.scaling_plot``), which is how the notebooks call them:

- ``collectives`` (00, 06): the all-reduce's bandwidth, a parameter server's staleness,
  compression's bytes against accuracy;
- ``augmentation`` (01): one image under many random augmentations;
- ``training`` (01, 02, 08): training curves (also live), scaling against its prediction,
  large-batch accuracy;
- ``pipeline`` (03, 10): pipeline timelines and the bubble;
- ``performance`` (04, 07, 11): techniques against their baselines, overlap, memory against a
  budget, the roofline;
- ``sequence`` (09): sequence parallelism, ring attention, experts over ranks;
- ``composition`` (10): ZeRO by hand, 2-D meshes, the planner.

Every figure is drawn in the course's style (``_common.course_style``: text no smaller than the
notebook's, no wider than its column, legends beside or below the data), which applies only
while a figure is made: the learner's own matplotlib settings stay as they were. The
interactive explorers (sliders over these figures) are in :mod:`labkit.explorers`.
matplotlib is imported inside each function, so ``import labkit`` stays light; headless (CI,
a worker, a shell) matplotlib falls back to the Agg backend by itself.
"""

from __future__ import annotations

from .augmentation import augmentation_grid, check_image
from .collectives import bandwidth_plot, bytes_accuracy_plot, staleness_plot
from .composition import mesh_plot, planner_check_plot, planner_plot, wire_plot, zero_plot
from .performance import memory_plot, overlap_plot, roofline_plot, tuning_plot
from .pipeline import bubble_plot, pipeline_timeline, schedule_timeline_plot
from .sequence import (
    expert_load_plot,
    expert_placement_plot,
    expert_traffic_matrix,
    ring_memory_plot,
    ring_schedule_plot,
    ring_work_plot,
    sp_activation_bytes,
    sp_layout,
)
from .training import large_batch_plot, live_training_curves, scaling_plot, training_curves

__all__ = ["bandwidth_plot", "staleness_plot", "bytes_accuracy_plot", "check_image",
           "augmentation_grid", "training_curves", "live_training_curves",
           "scaling_plot", "large_batch_plot", "pipeline_timeline", "bubble_plot",
           "schedule_timeline_plot", "tuning_plot", "overlap_plot", "memory_plot", "roofline_plot",
           "sp_activation_bytes", "sp_layout", "ring_schedule_plot", "ring_work_plot",
           "ring_memory_plot", "expert_traffic_matrix", "expert_load_plot",
           "expert_placement_plot", "zero_plot", "mesh_plot", "wire_plot",
           "planner_plot", "planner_check_plot"]
