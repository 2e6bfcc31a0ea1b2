"""The arithmetic a stage runs, chosen per device rather than left to whatever a library dispatches.

- ``invariant``: row-invariant GEMMs, norms, activations and attention for ``LayerBlock`` (a
  position's bits never depend on what shares its forward), the rotary table, and the SDPA
  backends a CUDA stage allows.
- ``check``: ``check_block``, the start-up proof of that property on a stage's own block.

Not here yet: batch-invariant Triton kernels and CUDA graphs for GPU stages (issue 12, which
needs a GPU to build and measure), quantized wire kernels. May import torch; importing this
package imports nothing.
"""
