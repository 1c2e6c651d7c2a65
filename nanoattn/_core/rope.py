"""Rotary position embeddings (RoPE) as today's models configure them: the frequency
table of a scaled RoPE (``"linear"``, ``"llama3"``, ``"yarn"``, ``"dynamic"``, with the
parameters transformers uses), partial rotary (only the first ``rotary_dim`` features
of each head rotate) and both layouts (``"half"``: feature i pairs with i + R/2;
``"interleaved"``: features 2i and 2i + 1).

The table is computed once, in float64 numpy, from static values: per-frequency
factors and one attention factor (YaRN's), so the rotation itself is the same few
elementwise operations for every kind and the attention kernels are unchanged.
Public as ``nanoattn.apply_rope``; the layers call it with their config's options.

Axis letters (docs/conventions.md): B batch, L tokens, N heads, H head width, R the
rotated width (``rotary_dim``, H by default).
"""

import dataclasses
import math
import numbers
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._base.validate import expect_floating, expect_integer, expect_shape, positive_number

ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic")
LAYOUTS = ("half", "interleaved")

# The keys each rope_type takes (besides rope_type), required ones first.
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
    "linear": (),
    "dynamic": (),
    "llama3": (),
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A validated ``rope_scaling`` (frozen and hashable, so a config stays a static
    argument). Built from a mapping by :func:`rope_scaling_of`; ``as_dict()`` gives the
    mapping back, with only the keys that were set.

    Attributes (transformers' names and meanings):
      rope_type: ``"linear"`` (every frequency divided by ``factor``), ``"llama3"``
        (Llama 3.1's smooth interpolation between long and short wavelengths),
        ``"yarn"`` (YaRN: interpolation by frequency band, and an attention factor
        on the rotated features), ``"dynamic"`` (NTK-aware: the base grows with the
        longest position once it passes ``original_max_position_embeddings``).
      factor: the context extension factor, > 0.
      low_freq_factor, high_freq_factor: llama3's band edges (> 0, low < high).
      original_max_position_embeddings: the pretraining context length (llama3,
        yarn; for dynamic the length beyond which the base grows, transformers'
        ``max_position_embeddings``).
      beta_fast, beta_slow: yarn's band edges in rotations (default 32 and 1).
      mscale, mscale_all_dim: yarn's attention factor is ``m(factor, mscale) /
        m(factor, mscale_all_dim)`` when both are set, ``m(s, c) = 0.1 c ln(s) + 1``.
      attention_factor: yarn's attention factor given directly (default
        ``m(factor, 1)``); it multiplies cos and sin, so scores grow by its square.
      truncate: yarn rounds its correction range to whole dimensions (default True).
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def as_dict(self) -> dict:
        """The mapping this was built from: ``rope_type`` and the keys that were set."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}


def _number(name: str, value, *, integer: bool = False):
    where = f"rope_scaling {name}"
    if integer:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{where} must be an int >= 1, got {value!r}")
        return int(value)
    return positive_number(where, value)


def rope_scaling_of(value) -> RopeScaling | None:
    """``value`` (None, a :class:`RopeScaling`, or a mapping with ``rope_type`` and the
    parameters of that type) as a validated :class:`RopeScaling`, or a one-line error
    naming the key."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"rope_scaling must be None or a mapping with a rope_type, got {type(value).__name__}"
        )
    items = dict(value)
    kind = items.pop("rope_type", items.pop("type", None))
    if kind not in ROPE_TYPES:
        hint = " (rope_scaling=None is plain RoPE)" if kind == "default" else ""
        raise ValueError(f"rope_scaling rope_type must be one of {ROPE_TYPES}, got {kind!r}{hint}")
    allowed = _REQUIRED[kind] + _OPTIONAL[kind]
    for key in items:
        if key not in allowed:
            where = {"rope_theta": "; it is rope_base", "partial_rotary_factor": "; see rotary_dim"}
            raise ValueError(
                f"rope_scaling key {key!r} is not a parameter of rope_type {kind!r}, which takes "
                f"{', '.join(allowed)}{where.get(key, '')}"
            )
    for key in _REQUIRED[kind]:
        if items.get(key) is None:
            raise ValueError(f"rope_scaling rope_type {kind!r} needs {key}")
    values = {}
    for key, v in items.items():
        if v is None:
            continue
        if key == "truncate":
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"rope_scaling truncate must be True or False, got {v!r}")
            values[key] = bool(v)
        elif key in ("mscale", "mscale_all_dim"):  # transformers reads 0 as unset
            values[key] = _number(key, v) if v else None
        else:
            values[key] = _number(key, v, integer=key == "original_max_position_embeddings")
    if kind == "llama3" and values["low_freq_factor"] >= values["high_freq_factor"]:
        raise ValueError(
            f"rope_scaling low_freq_factor={values['low_freq_factor']} must be below "
            f"high_freq_factor={values['high_freq_factor']}"
        )
    return RopeScaling(rope_type=kind, **values)


def check_rotary_dim(rotary_dim, head_dim: int, name: str = "rotary_dim") -> int:
    """``rotary_dim`` (None: the whole head) as an even int in [2, H], or a one-line error."""
    if rotary_dim is None:
        return head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(f"{name} must be an even int >= 2 or None, got {name}={rotary_dim!r}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"{name} must be an even int in [2, H] (the rotated features of each head), "
            f"got {name}={rotary_dim} with H={head_dim}"
        )
    return int(rotary_dim)


def check_layout(layout, name: str = "rope_layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be 'half' or 'interleaved', got {name}={layout!r}")
    return layout


def _yarn_factor(factor: float, c: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * c * math.log(factor) + 1.0


def frequencies(
    rotary_dim: int, base: float, scaling: RopeScaling | None, seq_len: int | None = None
) -> tuple[np.ndarray, float]:
    """The inverse frequencies (R/2,) in float64 and the attention factor of a RoPE.

    ``theta_i = base ** (-2i / R)`` scaled as ``scaling`` says (transformers'
    ``ROPE_INIT_FUNCTIONS``, in float64); ``seq_len`` is the longest position + 1,
    read only by ``"dynamic"``. The attention factor (1 except for yarn) multiplies
    cos and sin.
    """
    R = rotary_dim
    exponents = np.arange(0, R, 2, dtype=np.float64) / R  # (R/2,): 2i / R
    theta = base**-exponents
    if scaling is None:
        return theta, 1.0
    s = scaling
    if s.rope_type == "linear":
        return theta / s.factor, 1.0
    if s.rope_type == "dynamic":
        longest = max(seq_len or 0, s.original_max_position_embeddings)
        ratio = s.factor * longest / s.original_max_position_embeddings - (s.factor - 1)
        return (base * ratio ** (R / (R - 2))) ** -exponents, 1.0
    if s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / theta
        scaled = np.where(wavelen > low_wavelen, theta / s.factor, theta)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    # yarn
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_factor(s.factor, s.mscale) / _yarn_factor(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_factor(s.factor)
    beta_fast = s.beta_fast or 32.0
    beta_slow = s.beta_slow or 1.0

    def correction(rotations: float) -> float:  # the dimension that turns `rotations` times
        old = s.original_max_position_embeddings
        return R * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(beta_fast), correction(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(R // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # (R/2,): 1 keeps theta (high frequencies), 0 divides it
    return theta / s.factor * ramp + theta * extrapolation, attention


def _longest(positions) -> int:
    """max(positions) + 1 of concrete positions, for dynamic scaling."""
    if isinstance(positions, jax.core.Tracer):
        raise ValueError(
            "rope_scaling rope_type 'dynamic' needs concrete positions (its base grows with "
            "the longest one): call it outside jit, or pass positions as a numpy array"
        )
    positions = np.asarray(positions)
    return int(positions.max()) + 1 if positions.size else 0


def apply_rope(
    x, positions, *, base: float = 10000.0, rope_scaling=None, rotary_dim=None, rope_layout="half"
):
    r"""Rotates each head's features by angles proportional to the token's position.

    .. math::

       y_i = a (x_i \cos(p \theta_i) - x_{i + R/2} \sin(p \theta_i)), \quad
       y_{i + R/2} = a (x_{i + R/2} \cos(p \theta_i) + x_i \sin(p \theta_i))

    for each token and head, ``i < R/2``, frequencies ``theta_i = base ** (-2 i / R)``
    (scaled per frequency by ``rope_scaling``), ``p`` the token's integer position and
    ``a`` the attention factor (1 except for YaRN). Features ``R .. H - 1`` pass
    through unchanged. So ``<rope(q, m), rope(k, n)>`` depends on the positions only
    through ``m - n``, and position 0 is the identity (without an attention factor).

    Conventions: ``rope_layout="half"`` (the default) pairs feature ``i`` with
    ``i + R/2``, as GPT-NeoX, Llama's Hugging Face port, Gemma and equinox;
    ``"interleaved"`` pairs ``2i`` with ``2i + 1``, as the original RoFormer, GPT-J
    and Meta's Llama code. Weights trained with one layout work with the other
    after permuting the head features of the q and k projections once:
    ``perm = concat(arange(0, R, 2), arange(1, R, 2))`` (new feature ``i`` of the
    half layout is old interleaved feature ``perm[i]``).

    The frequency table is computed in float64 from static values; the rotation
    runs in float32 (float64 stays float64) and the result has ``x``'s dtype.

    Args:
      x: (B, L, N, H): queries or keys (N heads, or K key/value heads); H even
        unless ``rotary_dim`` is given.
      positions: integer (B, L) or (L,): each token's position.
      base: the frequency base (10000 in most models; larger for long context).
      rope_scaling: None, or a mapping with ``rope_type`` ``"linear"``,
        ``"llama3"``, ``"yarn"`` or ``"dynamic"`` and that type's parameters with
        transformers' names (``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
        ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate``; see
        ``RopeScaling``). ``"dynamic"`` reads the longest position, so its
        ``positions`` must be concrete (a ValueError under ``jit`` otherwise).
      rotary_dim: R, an even int <= H: only the first R features of each head
        rotate (partial rotary: Phi, GPT-NeoX, StableLM); None: all H.
      rope_layout: ``"half"`` or ``"interleaved"``.

    Returns:
      (B, L, N, H), ``x``'s dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> y = apply_rope(x, jnp.arange(3))
      >>> bool((y[:, 0] == x[:, 0]).all())  # position 0 is the identity
      True
      >>> llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
      ...               high_freq_factor=4.0, original_max_position_embeddings=16)
      >>> apply_rope(x, jnp.arange(3), base=500000.0, rope_scaling=llama3).shape
      (1, 3, 2, 4)
    """
    scaling = rope_scaling_of(rope_scaling)
    layout = check_layout(rope_layout)
    x_array = jnp.asarray(x)
    expect_shape("x", x_array.shape, "B L N H", (None,) * 4)
    expect_floating("x", x_array.dtype)
    B, L, _, H = x_array.shape
    if rotary_dim is None and H % 2:
        raise ValueError(f"apply_rope needs an even head width H, got x of shape {x_array.shape}")
    R = check_rotary_dim(rotary_dim, H)
    base = positive_number("base", base)
    seq_len = None
    if scaling is not None and scaling.rope_type == "dynamic":
        if R <= 2:
            raise ValueError(f"rope_scaling rope_type 'dynamic' needs rotary_dim > 2, got R={R}")
        seq_len = _longest(positions)
    positions = jnp.asarray(positions)
    expect_integer("positions", positions.dtype)
    if positions.ndim == 1:
        expect_shape("positions", positions.shape, "L", (L,))
        positions = positions[None]
    else:
        expect_shape("positions", positions.shape, "B L", (B, L))
    theta, factor = frequencies(R, base, scaling, seq_len)
    dtype = jnp.result_type(x_array.dtype, jnp.float32)
    freqs = jnp.asarray(theta, dtype)[None, None]  # (1, 1, R/2)
    angles = positions.astype(dtype)[..., None] * freqs  # (B|1, L, R/2)
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]  # (B|1, L, 1, R/2)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    xf = x_array.astype(dtype)
    turned, kept = xf[..., :R], xf[..., R:]  # (B, L, N, R), (B, L, N, H - R)
    if layout == "half":
        first, second = jnp.split(turned, 2, axis=-1)  # 2 x (B, L, N, R/2)
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    else:
        even, odd = turned[..., 0::2], turned[..., 1::2]  # 2 x (B, L, N, R/2)
        pairs = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        rotated = pairs.reshape(turned.shape)  # (B, L, N, R/2, 2) -> (B, L, N, R)
    if R < H:
        rotated = jnp.concatenate([rotated, kept], axis=-1)
    return rotated.astype(x_array.dtype)
