"""The GPipe engine: TensorFlow only, no Lingvo.

Runs K v chunk functions `(theta, inputs, state, micro_batch_id) ->
(outputs, state)` over M micro-batches on K devices in the order of a
schedule table, with re-materialized gradients.

Modules: `call` (the pipelined call every front end makes: partition, M,
engine), `pipeline` (the entry), `unrolled` and `loop` (the two engines),
`channel` (Send/Recv between the loop engine's per-device loops), `stage` and
`recompute` (one chunk's calls and their recomputing gradients), `microbatch`
(split and merge), `moments` (batch moments across micro-batches),
`placement` (local and cluster devices), `tpu` (TPU logical cores and device
assignment), `xla` (whether XLA compiles the step), `trace` (reading a traced
step's kernels back as chunk calls), `watched` (which input gradients can be
asked for, when the backward runs in the forward pass).
"""
