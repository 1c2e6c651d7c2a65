"""Verification toolkit: prove that an attention implementation hides the future,
sees exactly what its mask claims, ignores padding, normalises its rows, keeps its
axes straight, and decodes through its KV cache exactly what it computes on the
whole sequence.

Works on nanoattn's modules and on anyone else's attention function, decoder
or whole model (on float inputs or token ids). A decoder is ``(full, init, step)``
(a :class:`Decoder` adds its rewind and bounds); a decoder with a paged KV cache is
a :class:`PagedDecoder` (``init(pages)``, ``step(state, chunk, batch)`` over a
``PagedBatch``), which ``check_decoding`` runs through a ``PageAllocator``: pages
handed out shuffled and reused after poison (stale NaN and inf), ragged mixed
batches of prefill chunks and decode tokens, rewinds, and forks sharing a prefix.
See docs/verify.md.
"""

from . import decoders as decoders
from ._causality import check_causality as check_causality
from ._decoder import Decoder as Decoder
from ._decoding import check_decoding as check_decoding
from ._mask import check_mask as check_mask
from ._padding import check_padding as check_padding
from ._paged_decoding import PagedDecoder as PagedDecoder
from ._report import CheckResult as CheckResult
from ._report import Report as Report
from ._selection import check_selection as check_selection
from ._shapes import check_shapes as check_shapes
from ._weights import check_row_sums as check_row_sums
