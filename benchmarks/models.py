"""The models the benchmarks train: deep stacks of Lingvo FCLayers.

A configuration (see `runner.Config`) names one of three models over the
same cells: 'plain' (`builder_layers.SequentialLayer`), 'gpipe'
(GPipeSequentialLayer, with the configuration's engine) and 'lingvo'
(Lingvo's `gpipe.PipeliningLayer`, one `FeatureExtractionLayer` per stage).

Imports TensorFlow and Lingvo inside the functions: only worker processes
build models.
"""

import math
from typing import Any, Dict, List, Optional, Sequence


def FcCells(num_layers: int, dim: int, he_init: bool = True) -> List[Any]:
  """Params of `num_layers` Lingvo FCLayers 'fc0', 'fc1', ... (dim -> dim).

  Args:
    num_layers: Number of cells.
    dim: Input and output size of every cell (ReLU activation).
    he_init: Gaussian weights of std sqrt(2 / dim), which keep the ReLU
      activations' scale through deep stacks; else FCLayer's default.

  Returns:
    A list of FCLayer Params.
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import layers
  from lingvo.core import py_utils
  # pylint: enable=g-import-not-at-top
  init: Optional[Any] = (py_utils.WeightInit.Gaussian(math.sqrt(2.0 / dim))
                         if he_init else None)
  cells = []
  for i in range(num_layers):
    p = layers.FCLayer.Params().Set(name=f'fc{i}', input_dim=dim,
                                    output_dim=dim)
    if init is not None:
      p.params_init = init
    cells.append(p)
  return cells


def LossCell() -> Any:
  """Params of a last cell that computes the loss: mean(x^2), a scalar."""
  # pylint: disable=g-import-not-at-top
  from lingvo import compat as tf
  from lingvo.core import base_layer
  # pylint: enable=g-import-not-at-top

  class MeanSquareLoss(base_layer.BaseLayer):
    """The mean square of its input: the loss, inside the pipeline."""

    def FProp(self, theta, x):
      del theta
      return tf.reduce_mean(tf.square(x))

  return MeanSquareLoss.Params().Set(name='loss')


def UniformSplit(num_cells: int, num_stages: int) -> List[int]:
  """Cells per stage: equal counts, the first stages get one more."""
  base, extra = divmod(num_cells, num_stages)
  return [base + (k < extra) for k in range(num_stages)]


def BuildModel(config: Dict[str, Any],
               devices: Optional[Sequence[str]] = None):
  """Instantiates the configuration's model (in a graph or eagerly).

  Args:
    config: A configuration dict, see `runner.Config`.
    devices: The stages' devices (gpipe only); None: in graph mode Lingvo's
      cluster model split, else the first K logical CPU devices.

  Returns:
    A Lingvo layer: builder_layers.SequentialLayer (plain),
    GPipeSequentialLayer (gpipe) or gpipe.PipeliningLayer (lingvo).
  """
  # pylint: disable=g-import-not-at-top
  from lingvo.core import builder_layers
  from lingvo.core import gpipe
  from lingvo_gpipe import GPipeSequentialLayer
  # pylint: enable=g-import-not-at-top
  cells = FcCells(config['num_layers'], config['dim'])
  num_stages = config['stages']
  if config['model'] == 'plain':
    params = builder_layers.SequentialLayer.Params().Set(name='model',
                                                         sub=cells)
  elif config['model'] == 'lingvo':
    stages, start = [], 0
    for k, count in enumerate(UniformSplit(len(cells), num_stages)):
      stages.append(gpipe.FeatureExtractionLayer.Params().Set(
          name=f'stage{k}', sub=cells[start:start + count]))
      start += count
    params = gpipe.PipeliningLayer.Params().Set(
        name='model',
        cell_tpl=stages,
        num_micro_batches=config['micro_batches'])
  else:
    if devices is None and config.get('mode', 'graph') != 'graph':
      devices = [f'/device:CPU:{k}' for k in range(num_stages)]
    schedule = config.get('schedule', 'gpipe')
    if schedule != 'gpipe':  # The loss inside: its own cell.
      cells.append(LossCell())
    params = GPipeSequentialLayer.Params().Set(
        name='model',
        cell_tpl=cells,
        num_stages=num_stages,
        num_micro_batches=config['micro_batches'],
        remat=config['remat'],
        devices=devices,
        engine=config.get('engine', 'auto'),
        schedule=schedule,
        virtual_stages=config.get('virtual_stages', 1),
        partition='params' if schedule != 'gpipe' else 'uniform')
  return params.Instantiate()


def BuildModelWithWeightsOnStages(config: Dict[str, Any],
                                  devices: Sequence[str]):
  """The 'gpipe' model in graph mode, each cell's variables on its stage.

  An accelerator holds its stage's weights. The model is built once in a
  scratch graph to learn each cell's device (`CellDevices`), then in the
  default graph with the variables of cell i (under 'model/<cell i>/') on
  that device.

  Args:
    config: A 'gpipe' configuration dict, see `runner.Config`.
    devices: The stages' devices.

  Returns:
    The GPipeSequentialLayer.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    scratch = BuildModel(config, devices)
    cell_devices = dict(zip((c.name for c in scratch.params.cell_tpl),
                            scratch.CellDevices()))

  def PlaceOnItsCellsDevice(op):
    scopes = op.name.split('/')
    if len(scopes) > 2 and scopes[0] == 'model':
      return cell_devices.get(scopes[1], op.device)
    return op.device

  with tf.compat.v1.device(PlaceOnItsCellsDevice):
    return BuildModel(config, devices)


def Loss(y):
  """The scalar loss: mean(y^2) of the model's output, or the output itself.

  Args:
    y: The model's output (a tensor or a 1-tuple), or the loss a pipeline
      computed in its last cell (a scalar).

  Returns:
    A scalar.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if isinstance(y, (list, tuple)):
    (y,) = y
  return y if y.shape.rank == 0 else tf.reduce_mean(tf.square(y))
