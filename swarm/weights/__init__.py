"""Weights: per-tensor manifests and the model id that names a model on the swarm. No torch."""
