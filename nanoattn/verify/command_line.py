"""What the commands ``nanoattn verify`` and ``nanoattn audit`` (``nanoattn/cli/``) take
from the toolkit beyond its public checks: the checks' default lengths (for ``--help``
and the title lines), the reading of a ``--decode`` target as a decoder, the lengths a
``--max-len`` keeps and whether the target raised at every length, and the audit's
pieces. Not a user API: it changes with the command line. The checks themselves are
:mod:`nanoattn.verify`'s.
"""

from ._audit import ALLOWED, FUTURE, PADDING, blocked_row_example, mask_examples, verify_modules
from ._bounds import raised_everywhere, within
from ._causality import DEFAULT_SEQ_LENS as CAUSALITY_SEQ_LENS
from ._decoder import as_decoder
from ._decoding import CAPACITY_SLACK, LAPS, default_seq_len
from ._decoding import DEFAULT_SEQ_LEN as DECODE_SEQ_LEN
from ._latent_audit import latent_shapes
from ._mask import DEFAULT_SEQ_LENS as MASK_SEQ_LENS

__all__ = [
    "ALLOWED",
    "CAPACITY_SLACK",
    "CAUSALITY_SEQ_LENS",
    "DECODE_SEQ_LEN",
    "FUTURE",
    "LAPS",
    "MASK_SEQ_LENS",
    "PADDING",
    "as_decoder",
    "blocked_row_example",
    "default_seq_len",
    "latent_shapes",
    "mask_examples",
    "raised_everywhere",
    "verify_modules",
    "within",
]
