"""GPipe for Keras 3: `GPipeSequential`, a layer that pipelines its layers.

    >>> import keras
    >>> import numpy as np
    >>> from lingvo_gpipe.keras import GPipeSequential
    >>> model = keras.Sequential([
    ...     keras.Input((16,)),
    ...     GPipeSequential([keras.layers.Dense(16, activation='relu')
    ...                      for _ in range(4)], num_stages=2,
    ...                     num_micro_batches=2),
    ...     keras.layers.Dense(10)])
    >>> model(np.ones([4, 16])).shape
    TensorShape([4, 10])

Loads TensorFlow and Keras, never Lingvo. Modules: `layer` (the Keras layer),
`stages` (Keras layers as the engine's stage functions: weights, seed and
batch-norm state), `costs` ('params' and 'profile' partitions), `devices`
(stage devices per replica). docs/keras.md has the guide.
"""

from lingvo_gpipe.keras.layer import GPipeSequential

__all__ = ['GPipeSequential']
