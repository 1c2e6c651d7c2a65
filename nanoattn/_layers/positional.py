"""The layer's positional rules as mask functions over positions, shared by training
(``nanoattn._layers.steps.self_attention``) and by the cache policies
(``nanoattn._layers.caches``), which map them onto the slots of their cache.

A mask function is ``mask_fn(b, n, q_pos, k_pos) -> bool`` and a score function
``score_fn(score, b, n, q_pos, k_pos) -> score``, as in
``nanoattn.dot_product_attention`` (docs/masks.md); None means no rule.
"""


def visible(q_pos, key_pos, window: int, sink_tokens: int):
    """Whether a query at ``q_pos`` sees the key at ``key_pos`` (broadcasting int
    arrays; ``key_pos`` -1 for an empty slot): causal, within ``window`` positions,
    or one of the first ``sink_tokens`` positions."""
    seen = (key_pos >= 0) & (key_pos <= q_pos)
    return seen & ((q_pos - key_pos <= window) | (key_pos < sink_tokens))


def window_mask(window, sink_tokens: int):
    """With ``sink_tokens`` S0 > 0, the window ``(W, right)`` as a mask_fn that keeps
    the first S0 positions visible (the core's ``window`` option then stays unused):
    causal, and within ``W`` positions or one of the first S0. None without sink
    tokens, where the core's ``window`` option is the rule."""
    if not sink_tokens:
        return None
    W = window[0]

    def window_or_sink(b, n, q_pos, k_pos):
        return visible(q_pos, k_pos, W, sink_tokens)

    return window_or_sink


def and_masks(first, second):
    """The mask_fn allowing what both allow; either may be None."""
    if first is None or second is None:
        return first if second is None else second

    def both(b, n, q_pos, k_pos):
        return first(b, n, q_pos, k_pos) & second(b, n, q_pos, k_pos)

    return both


def at_positions(fn, key_positions, scores: bool):
    """``mask_fn`` (``scores`` False) or ``score_fn`` (``scores`` True) called with
    each slot's position (``key_positions`` (B, S) int) in place of the slot index:
    the user's functions see positions whatever slot holds them. None stays None."""
    if fn is None:
        return None
    if scores:
        return lambda score, b, n, q_pos, k: fn(score, b, n, q_pos, key_positions[b, k])
    return lambda b, n, q_pos, k: fn(b, n, q_pos, key_positions[b, k])
