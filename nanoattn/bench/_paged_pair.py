"""Two paged calls that differ by one keyword (a shared prefix, a token tree), jitted
once, for a part that times the one against the other (:mod:`._cascade`,
:mod:`._tree`)."""

import jax

from .._core.paged import paged_attention


def with_and_without(keyword: str, value, names: tuple[str, str], arrays, implementation):
    """``{names[0]: (fn, args), names[1]: (fn, args)}``: ``paged_attention`` over
    ``arrays`` (query, key pages, value pages, page table, kv_lengths, query_starts)
    with ``keyword=value``, and without it, on ``implementation``."""
    q, k, v, table, lengths, starts = arrays

    def attend(q, k, v, given=None):
        return paged_attention(q, k, v, table, lengths, starts, **{keyword: given},
                               implementation=implementation)  # fmt: skip

    call = jax.jit(attend)
    return {names[0]: (call, (q, k, v, value)), names[1]: (call, (q, k, v))}
