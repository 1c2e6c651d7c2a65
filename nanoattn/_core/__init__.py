"""The core: the public functions above the kernels (:mod:`.api`, :mod:`.paged`,
:mod:`.quantize`), eager calls compiled once (:mod:`.eager`), merging over disjoint
keys (:mod:`.merge`) and RoPE (:mod:`.rope`). The rules of a call and the numerics
every kernel shares live below the kernels, in ``nanoattn._base``
(docs/architecture.md)."""
