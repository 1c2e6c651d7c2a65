"""The attention backends, one module or folder each, behind one interface
(:mod:`.interface`), named in :mod:`.registry` and chosen by :mod:`.dispatch`.
Adding a backend: docs/architecture.md."""
