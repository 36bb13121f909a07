"""Sampling on the device: counter-based randomness, the sampler stages, draft verification."""
