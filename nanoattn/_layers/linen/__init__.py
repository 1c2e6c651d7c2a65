"""The Flax linen modules (public as :mod:`nanoattn.linen`)."""
