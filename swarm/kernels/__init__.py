"""The arithmetic a stage runs, chosen per device rather than left to whatever a library dispatches.

- ``fma``: the fma kernel mode: batch-invariant GEMM (float32 or bfloat16 weights), attention
  (float32 or bfloat16 caches), RMSNorm and SiLU in one arithmetic (``fma.c`` states it) that the
  AVX-512, AVX2 + FMA and NEON paths (``fma_kernels.h``) compute bit for bit alike; whole chunks per
  call, through ctypes; ``fma_layer.c`` runs a whole Llama-structured decoder layer in one call through
  those kernels (``decoder_layer``: the module path's operations and roundings, in its order).
- ``build``: the kernels' sources, flags and digest: ``setup.py`` builds them into the extension
  ``swarm.kernels._fma`` at install; ``fma`` builds them at run time only where that is missing.
- ``qblocks``: weights held in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and their
  GEMM in the same arithmetic family (``qblocks_kernels.h``: activations quantized per row, integer
  dots per block, float accumulation in a fixed order); ``qquantize.c`` writes Q4_K and Q6_K from float
  weights with the bytes of llama.cpp's reference quantizers.
- ``fp8``: FP8 and MXFP4 weights held as published, multiplied with the bits of the float GEMM over the
  dequantized weight (``fp8.c`` decodes in registers or a panel of rows, then runs that GEMM).
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
