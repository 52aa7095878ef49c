"""The public path of the partitioner (`lingvo_gpipe.partition.PartitionCosts`).

The implementation is `lingvo_gpipe.planning.partition`, which needs neither
TensorFlow nor Lingvo.

    >>> PartitionCosts([1, 4, 4, 4, 4, 8], num_stages=3)
    [3, 2, 1]
"""

from lingvo_gpipe.planning import partition as _partition

CheckNumStages = _partition.CheckNumStages
CheckPartition = _partition.CheckPartition
Imbalance = _partition.Imbalance
LingvoPartition = _partition.LingvoPartition
PartitionCosts = _partition.PartitionCosts
StageSums = _partition.StageSums
UniformPartition = _partition.UniformPartition
