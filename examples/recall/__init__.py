"""A small decoder built on nanoattn, end to end: trained on multi-query associative
recall and copy, checkpointed with orbax, generating through the KV cache, and
verified as a whole model with ``nanoattn.verify``.

Run from the repository root: ``python -m examples.recall train|generate|verify``
(each with ``--help``). See examples/recall/README.md.
"""
