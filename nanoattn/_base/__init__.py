"""What every kernel builds on: the rules of a call (:mod:`.rules`), validation,
masks, masks as functions and their block classification, the shared numerics, and
small helpers for traces, shard_map and sequence layouts (docs/architecture.md)."""
