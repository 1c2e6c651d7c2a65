"""The Flax NNX modules (public as :mod:`nanoattn.nnx`)."""
