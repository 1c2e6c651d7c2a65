"""The KV caches of decoding (docs/decoding.md)."""
