"""What the registered GPipe models share: a task around one pipeline.

    class MyTask(pipelined_task.PipelinedTask):
      def ComputePredictions(self, theta, input_batch):
        return py_utils.NestedMap(
            logits=self.stack.FProp(theta.stack, input_batch.x))
"""

from lingvo import compat as tf
from lingvo.core import base_model
from lingvo.core import schedule

from lingvo_gpipe import GPipeSequentialLayer


class PipelinedTask(base_model.BaseTask):
  """A Lingvo task whose model is the pipeline `self.stack`.

  A GPipeSequentialLayer, or a layer of lingvo_gpipe.stacks.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', GPipeSequentialLayer.Params(),
             'The pipeline: the model from inputs to logits.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('stack', self.params.stack)

  def PipelineMetrics(self, batch_size):
    """{'bubble_fraction': (value, 1)} in training, for Lingvo's summaries.

    Args:
      batch_size: The static batch size the pipeline splits.

    Returns:
      Lingvo metrics: the idle fraction (K - 1) / (M + K - 1) of a training
      step, or {} in eval.
    """
    if self.do_eval:
      return {}
    bubble = self.stack.BubbleFraction(batch_size)
    return {'bubble_fraction': (tf.constant(bubble), tf.constant(1.0))}


def SoftmaxMetrics(logits, labels, weights):
  """Weighted mean cross entropy and accuracy of logits against labels.

  Args:
    logits: float [..., num_classes].
    labels: int32 [...].
    weights: float [...], 0 where a position does not count.

  Returns:
    (loss, accuracy, total weight), scalars.
  """
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits)
  correct = tf.cast(
      tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels),
      tf.float32)
  count = tf.reduce_sum(weights)
  return (tf.reduce_sum(xent * weights) / count,
          tf.reduce_sum(correct * weights) / count, count)


def SetTrainSchedule(train_params, learning_rate, max_steps, final_value,
                     save_interval_steps):
  """Adam with linear warm-up (a tenth of the steps), then cosine decay.

  Args:
    train_params: A task's `train` Params, changed in place.
    learning_rate: The peak learning rate.
    max_steps: Training steps; the decay ends there.
    final_value: The last learning rate, as a fraction of the peak.
    save_interval_steps: Checkpoint period.
  """
  train_params.max_steps = max_steps
  train_params.learning_rate = learning_rate
  train_params.lr_schedule = schedule.LinearRampupCosineSchedule.Params().Set(
      warmup_steps=max_steps // 10, total_steps=max_steps,
      final_value=final_value)
  train_params.save_interval_steps = save_interval_steps
  train_params.summary_interval_steps = 10
