"""The layers: the configuration (:mod:`.config`), the steps linen and NNX share
(:mod:`.heads`, :mod:`.steps`), RoPE with the scalings of today's models (:mod:`.rope`)
and the QK norms (:mod:`.norm`), the KV caches (:mod:`.caches`), the mesh-sharded call
(:mod:`.sharded`) and the two module families (:mod:`.linen`, :mod:`.nnx`)."""
