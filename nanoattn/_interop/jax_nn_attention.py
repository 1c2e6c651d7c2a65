"""``jax_nn_attention``: nanoattn with the signature and the results of
``jax.nn.dot_product_attention``, for code written against it.

The call is checked as jax.nn checks it (:mod:`nanoattn._interop.jax_nn_inputs`), served by
one call of the functional core (``nanoattn.dot_product_attention``, so by its
automatic choice among the reference, the flash kernel and the native kernel), and
its results are made jax.nn's where nanoattn's contract differs
(:mod:`nanoattn._interop.jax_nn_rows`): a row that sees no key, padded queries, the residual.
docs/jax_nn.md maps every argument.

Axis letters (docs/conventions.md): B batch, T query time, S key time, N query heads,
K key/value heads, G = N / K, H head width.
"""

from typing import Literal

import jax.numpy as jnp

from .._base.debug import one_program
from .._base.numerics import softmax_dtype
from .._base.rules import Rules, poison_rows
from .._base.validate import check_scale, expect_flag, lengths_outside
from .._core.api import attend
from .jax_nn_inputs import check_implementation, check_window, checked
from .jax_nn_rows import as_jax_nn, query_valid, sees_a_key


def jax_nn_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cudnn"] | None = None,
    return_residual: bool = False,
):
    r"""``jax.nn.dot_product_attention``, computed by nanoattn.

    .. math::

       \mathrm{out}_{btnh} = \sum_s P_{bnts} \, V_{bskh}, \qquad
       P_{bnt\cdot} = \mathrm{softmax}_{s}
         \Big(\mathrm{scale} \sum_h Q_{btnh} K_{bskh} + \mathrm{bias}_{bnts}
              \ \text{at allowed } s, \ \text{else } L\Big)

    where key/value head ``k = n // G`` serves query head ``n`` (``G = N / K``) and
    ``L`` is jax.nn's large negative number (-0.7 times float32's largest). Key ``s``
    is allowed for query ``t`` when ``mask`` allows it, ``s <= t`` with
    ``is_causal``, ``t - left <= s <= t + right`` with ``local_window_size=(left,
    right)``, and ``s < key_value_seq_lengths[b]``: the rules of jax.nn, aligned
    top-left when T != S (query ``t`` sits at key position ``t``). Rows
    ``t >= query_seq_lengths[b]`` are zeros. Axis letters: B batch, T query time,
    S key time, N query heads, K key/value heads, H head width.

    Every argument and result is jax.nn's; where nanoattn's own contract
    (docs/conventions.md) differs, the results are made jax.nn's: a row that sees no
    key returns the mean of its values over all S keys, with that mean's gradient
    (nanoattn: zeros); a padded query row returns zeros and its queries are never
    read; the residual is jax.nn's, ``L`` (cast to the dtype: ``-inf`` in float16)
    for a row that sees no key or is padded, without gradient (nanoattn: ``-inf``,
    differentiable). What stays nanoattn's: float64 inputs keep a float64 softmax
    (jax.nn's runs in float32), NaN or inf in content no query may see does not
    reach the output (jax.nn's does: ``0 * NaN``), and a window side below 0 raises.
    docs/jax_nn.md lists every mapping and difference.

    Args:
      query: (B, T, N, H), or unbatched (T, N, H).
      key: (B, S, K, H) or (S, K, H), K dividing N; value: the key's shape. Query,
        key and value share one dtype.
      bias: optional, up to four axes, broadcastable to (B, N, T, S) (ones put in
        front), added to the scaled logits; a non-float bias is cast to float.
      mask: optional boolean, up to four axes, broadcastable to (B, N, T, S);
        True = may attend.
      scale: factor on ``q . k``; None: ``1 / sqrt(H)``.
      is_causal: query ``t`` may see keys ``s <= t`` (top-left when T != S).
      query_seq_lengths: optional int32 (B,): rows ``t >= query_seq_lengths[b]``
        are padding (zeros out, residual ``L``).
      key_value_seq_lengths: optional int32 (B,): keys ``s >= key_value_seq_lengths[b]``
        are hidden.
      local_window_size: an int ``w`` (``(w, w)``) or ``(left, right)``, both >= 0:
        query ``t`` may see keys ``t - left .. t + right``.
      implementation: None or ``"xla"``: nanoattn's automatic choice (the
        reference, the flash kernel or the native kernel on CPU; never cuDNN);
        ``"cudnn"``: nanoattn's cuDNN backend (NVIDIA GPUs, half precision), which
        raises ValueError where it cannot serve the call (off GPU, a window, the
        residual).
      return_residual: also return the log-sum-exp of each row's logits.

    Returns:
      the output, the query's shape and dtype; with ``return_residual``, ``(out,
      lse)`` with ``lse`` (B, T, N) or (T, N) in the query's dtype.

    Raises:
      ValueError: one line naming the argument: shapes or dtypes jax.nn rejects (and
        a mask or bias whose head axis is neither 1 nor N, where jax.nn asserts), a
        window side below 0, an implementation name that is not jax.nn's, or
        ``"cudnn"`` where it cannot serve the call.
      TypeError: ``is_causal`` or ``return_residual`` not a bool, an argument that is
        not an array.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from nanoattn import jax_nn_attention
      >>> q = jax.random.normal(jax.random.key(0), (2, 13, 4, 8))  # (B, T, N, H)
      >>> k = v = jax.random.normal(jax.random.key(1), (2, 7, 2, 8))  # (B, S, K, H)
      >>> lengths = jnp.array([7, 3], jnp.int32)
      >>> ours = jax.jit(jax_nn_attention, static_argnames="is_causal")
      >>> out = ours(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
      >>> theirs = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")
      >>> want = theirs(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
      >>> out.shape, bool(jnp.allclose(out, want, atol=1e-5))
      ((2, 13, 4, 8), True)
    """
    check_implementation(implementation)
    is_causal = expect_flag("is_causal", is_causal)
    return_residual = expect_flag("return_residual", return_residual)
    window = check_window(local_window_size)
    arrays = checked(query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths)
    q, k, v = arrays.query, arrays.key, arrays.value
    q_valid = None
    if arrays.q_lengths is not None:
        q_valid = query_valid(arrays.q_lengths, q.shape[1])  # (B, T)
        q = jnp.where(q_valid[:, :, None, None], q, jnp.zeros((), q.dtype))  # padding unread
    bias = arrays.bias
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        bias = bias.astype(softmax_dtype(q.dtype))  # jax.nn adds it to float logits
    # The log-sum-exp tells the rows that see no key (-inf, docs/conventions.md) on
    # every backend but cuDNN, which gives none: there the rules tell them.
    cudnn = implementation == "cudnn"
    with_lse = return_residual or not cudnn
    rules = Rules.make(
        q, k, v, mask=arrays.mask, bias=bias, is_causal=is_causal,
        kv_lengths=arrays.kv_lengths, window=window, scale=check_scale(scale),
        # jax.nn's alignment: query t sits at key position t
        q_offset=0 if is_causal or window is not None else None, return_residual=with_lse,
    )  # fmt: skip

    def run(q, k, v, rules, q_valid, q_lengths):
        result = attend(q, k, v, rules, implementation="cudnn" if cudnn else None)
        if with_lse:
            out, lse = result
            sees = lse != -jnp.inf  # (B, T, N); NaN content is not "sees no key"
        else:
            out, lse = result, None
            sees = sees_a_key(rules)
        out, lse = as_jax_nn(out, lse if return_residual else None, v, sees, q_valid)
        if q_lengths is not None:  # lengths outside [0, T] under jit: NaN rows
            out, lse = poison_rows((out, lse), lengths_outside(q_lengths, q.shape[1]))
        return out, lse

    # one program under jax's debug flags: the -inf kept for rows that see no key is
    # internal, as jax.nn keeps none (nanoattn/_base/debug.py)
    out, lse = one_program(run, q, k, v, rules, q_valid, arrays.q_lengths)
    out = out.reshape(arrays.shape)
    if not return_residual:
        return out
    return out, lse.reshape(arrays.shape[:-1])
