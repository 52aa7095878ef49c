"""Small hand-made profiles for the tests of the planner's modules.

Cells whose costs are round numbers, so that tests of `planning.predict`,
`planning.search`, `planning.calibrate` and `planning.search_report` can
check predictions by hand.
"""

from lingvo_gpipe.planning import profile as profile_lib

Affine = profile_lib.Affine


def Cell(name, forward=(1.0, 1.0), backward=(1.0, 2.0), update=0.0,
         activation=0.0, output=0.0, weight=0.0, gradient=0.0, slot=0.0):
  """A cell of (fixed, per-example) forward and backward seconds and bytes."""
  return profile_lib.CellProfile(
      name=name, forward_s=Affine(*forward), backward_s=Affine(*backward),
      update_s=update, activation_bytes=activation, output_bytes=output,
      weight_bytes=weight, gradient_bytes=gradient, slot_bytes=slot)


def Profile(cells, batch_size=4, **kwargs):
  """A profile of `cells` with no input bytes and a batch of `batch_size`."""
  return profile_lib.Profile(cells=tuple(cells), input_bytes=0.0,
                             batch_size=batch_size, **kwargs)


def Shape(num_stages, num_micro_batches, remat, **kwargs):
  """A `profile.PipelineShape`: K, M and the remat mode, then keywords."""
  return profile_lib.PipelineShape(num_stages=num_stages,
                                   num_micro_batches=num_micro_batches,
                                   remat=remat, **kwargs)


# Two cells; a call of one cell on n examples: forward 1 + n, backward
# 1 + 2n (seconds); 100 bytes of weights each.
TWO_CELLS = [Cell('a', weight=100.0), Cell('b', weight=100.0)]
