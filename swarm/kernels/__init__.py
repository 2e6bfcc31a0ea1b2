"""Attention backends, CUDA graphs and quantized wire kernels (may import torch).

Empty for now: layer blocks use transformers' own SDPA attention (``swarm.model.block``), and
tensors travel in the model dtype. Custom kernels land here when a benchmark shows they pay.
"""
