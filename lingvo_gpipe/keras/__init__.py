"""GPipe for Keras 3: `GPipeSequential`, a layer that pipelines its layers.

    from lingvo_gpipe.keras import GPipeSequential
    model = keras.Sequential([
        keras.Input((784,)),
        GPipeSequential([keras.layers.Dense(512, activation='relu')
                         for _ in range(8)], num_stages=4,
                        num_micro_batches=8),
        keras.layers.Dense(10)])

Loads TensorFlow and Keras, never Lingvo. Modules: `layer` (the Keras layer),
`stages` (Keras layers as the engine's stage functions: weights, seed and
batch-norm state), `costs` ('params' and 'profile' partitions), `devices`
(stage devices per replica). docs/keras.md has the guide.
"""

from lingvo_gpipe.keras.layer import GPipeSequential

__all__ = ['GPipeSequential']
