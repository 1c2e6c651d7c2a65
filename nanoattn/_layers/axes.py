"""The axis labels of the shape audit and the size each stands for.

The legend letters of docs/conventions.md (B T S N K H D), and the widths of the
layers' projections: ``3D`` or ``(N+2K)H`` (q | k | v), ``D`` or ``NH`` (q alone, and
the concatenated heads), ``D`` or ``KH`` (k or v alone), ``2D`` or ``2KH``
(cross-attention's k | v); the first of each pair when K = N and N H = D, so a
multi-head layer keeps the seed's names. The layers label
every stage they check with :func:`labels` (``nanoattn._base.trace.check_shape``) and
the audit checks every stage against :func:`axis_sizes`: one table, so a label
cannot stand for two sizes.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Labels:
    """The labels that depend on the configuration.

    Attributes:
      qkv: the width of the fused q | k | v projection.
      q_width: the width of q before the head split (and of the concatenated heads).
      kv_heads: the key/value heads axis.
      kv_width: the width of k or v before the head split.
      kv_pair: the width of cross-attention's fused k | v projection.
    """

    qkv: str
    q_width: str
    kv_heads: str
    kv_width: str
    kv_pair: str


def labels(config) -> Labels:
    """The labels of an ``AttentionConfig``'s stages."""
    D, N, K, H = config.d_model, config.n_heads, config.kv_heads, config.head_dim
    if N * H != D:  # a head width of its own (AttentionConfig.head_dim)
        heads = "N" if K == N else "K"
        return Labels(qkv="(N+2K)H", q_width="NH", kv_heads=heads, kv_width="KH", kv_pair="2KH")
    if K == N:
        return Labels(qkv="3D", q_width="D", kv_heads="N", kv_width="D", kv_pair="2D")
    return Labels(qkv="(N+2K)H", q_width="D", kv_heads="K", kv_width="KH", kv_pair="2KH")


def axis_sizes(config, batch: int, seq_len: int, kv_len: int | None = None) -> dict[str, int]:
    """The size every label stands for, e.g. ``{"B": 2, "3D": 384, ...}``; S is
    ``kv_len`` (cross-attention's context) or, when None, ``seq_len``."""
    D, N, K, H = config.d_model, config.n_heads, config.kv_heads, config.head_dim
    return {
        "B": batch,
        "T": seq_len,
        "S": seq_len if kv_len is None else kv_len,
        "N": N,
        "K": K,
        "H": H,
        "D": D,
        "2D": 2 * D,
        "3D": 3 * D,
        "KH": K * H,
        "NH": N * H,
        "2KH": 2 * K * H,
        "(N+2K)H": (N + 2 * K) * H,
    }
