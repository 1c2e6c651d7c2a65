"""The core: the public functions (:mod:`.api`), merging over disjoint keys
(:mod:`.merge`) and RoPE (:mod:`.rope`), over :mod:`.base`, the rules of a call and
the numerics every kernel shares (docs/architecture.md)."""
