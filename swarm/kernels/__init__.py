"""The arithmetic a stage runs, chosen per device rather than left to whatever a library dispatches.

- ``fma``: the fma kernel mode: batch-invariant float32 GEMM, attention, RMSNorm and SiLU for
  x86-64 CPUs with AVX2 and FMA (``fma.c``, built once per machine, called through ctypes), whole
  chunks per call.
- ``triton_ops``: the triton kernel mode: the same contract in Triton kernels (GEMM in fixed tiles
  without split-K, attention per query row in fixed 64-key blocks, RMSNorm, SiLU) for CUDA stages,
  and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``), which is where it is tested.
- ``invariant``: the rows mode (stock torch ops one row at a time: GEMMs, norms, activations and
  attention for ``LayerBlock``), fixed-width tiles for the norms and activations fma.c lacks, the
  rotary table, and the SDPA backends a CUDA stage allows.
- ``check``: ``check_block``, the start-up proof of that property on a stage's own block.
- ``quant``: weight-only int8 and int4 weights held quantized, multiplied by torch's own CPU ops in
  fixed-shape bfloat16 row calls.
- ``facts``: the facts a block's bits depend on (device, ISA, BLAS, versions, dtype, kernel mode and
  its constants, weights digest) as a reproducibility class (``swarm.repro``).

Not here yet: the triton mode's figures on a real GPU (its bits there are proven by each stage's
check_block and the ``gpu`` tests, which no session has run: no GPU lent; tiles untuned), CUDA graphs
(issue 12), quantized wire kernels.
Rule: may import the shared core (``swarm.config``); torch, triton (``triton_ops`` only). Importing this
package imports nothing.
"""
