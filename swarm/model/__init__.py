"""Models: resolution of a model spec to a local directory, layer blocks and the KV cache.

May import torch, transformers, safetensors and huggingface_hub; never networking of our own.
"""
