"""Adapters to other libraries' calling conventions: flax's ``attention_fn``
(:mod:`.flax_attention_fn`) and ``jax.nn.dot_product_attention``
(:mod:`.jax_nn_attention`); and transformers' checkpoints, one attention layer at a
time (:mod:`.transformers`)."""
