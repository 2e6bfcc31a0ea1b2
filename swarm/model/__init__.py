"""Models: resolution of a model spec to a local directory, layer blocks and the KV cache.

Rule: may import the shared core, ``kernels`` and ``weights``; torch, transformers, safetensors, huggingface_hub;
never networking of our own. Importing this package imports nothing.

- ``resolve``      a model spec (directory, name, GGUF, hub id) -> a local safetensors directory
- ``gguf_tensors`` a stage's tensors read from a GGUF file, llama.cpp's block formats kept (no dequantizing)
- ``qcheckpoint``  quantized checkpoints as published (FP8 with block scales, MXFP4 experts), dequantized at load
- ``qformats``     a block's Linear weights held in llama.cpp's block formats (``--quantize q8_0|...|gguf``)
- ``block``        ``LayerBlock``: a stage's layers ``[start, end)`` loaded from only its own tensors
- ``cache``        ``KVCache``: the per-session KV cache, addressed by absolute position
- ``fused``        the fma mode's Llama-structured decoder layers, one C call each (the module path's bits)
- ``sampling``     keyed sampling: the token at position n drawn with noise keyed by (seed, n)
- ``recompute``    a block re-run on a stage's opened input rows: the rows it should have sent (audits)
- ``moe``          sparse mixture-of-experts blocks run per token, stable routing, per-expert weights fused
- ``mla``          multi-head latent attention (DeepSeek-V3): latents cached, attention one row at a time
- ``plan``         memory planning: bytes per layer and per token of KV, splits of the layers over cards
"""
