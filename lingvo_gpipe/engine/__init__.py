"""The GPipe engine: TensorFlow only, no Lingvo.

Runs K stage functions `(theta, inputs, state, micro_batch_id) -> (outputs,
state)` over M micro-batches on K devices, with re-materialized gradients.

Modules: `pipeline` (the engine), `stage` and `recompute` (one stage's calls
and their recomputing gradients), `microbatch` (split and merge), `placement`
(local and cluster devices), `tpu` (TPU logical cores and device assignment),
`trace` (reading a traced step's kernels back as stage calls), `watched`
(which input gradients can be asked for, when the backward runs in the
forward pass).
"""
