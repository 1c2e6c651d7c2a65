"""The attention configuration: a frozen dataclass validated on construction."""

import dataclasses

from .._dispatch import IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Sizes of a multi-head attention layer.

    Attributes:
      d_model: D, the model width.
      n_heads: N, the number of heads; must divide ``d_model``.
      dropout: dropout rate on the attention weights, in [0, 1).
      implementation: the attention backend, ``"xla"``, ``"flash"``,
        ``"cudnn"`` or None for the automatic choice (see
        ``nanoattn.dot_product_attention``). Training with dropout uses the
        reference under the automatic choice.

    Example:
      >>> AttentionConfig(d_model=128, n_heads=4).head_dim
      32
    """

    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0
    implementation: str | None = None

    def __post_init__(self):
        if self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got n_heads={self.n_heads}")
        if self.d_model < 1:
            raise ValueError(f"d_model must be >= 1, got d_model={self.d_model}")
        if self.d_model % self.n_heads != 0:
            divisors = [n for n in range(1, self.d_model + 1) if self.d_model % n == 0]
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}, so the "
                f"heads cannot split it into equal widths; head counts that divide "
                f"{self.d_model}: {', '.join(map(str, divisors))}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout}")
        if self.implementation is not None and self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {', '.join(map(repr, IMPLEMENTATIONS))} or "
                f"None, got {self.implementation!r}"
            )

    @property
    def head_dim(self) -> int:
        """H, the width of one head: ``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @classmethod
    def from_config(cls, config) -> "AttentionConfig":
        """Accepts an AttentionConfig or any object with ``d_model``, ``n_heads``
        and (optionally) ``dropout``, such as the NanoMoE seed's config."""
        if isinstance(config, cls):
            return config
        try:
            return cls(
                config.d_model,
                config.n_heads,
                getattr(config, "dropout", 0.0),
                getattr(config, "implementation", None),
            )
        except AttributeError as e:
            raise TypeError(
                f"config must be an AttentionConfig or have d_model and n_heads, "
                f"got {type(config).__name__}"
            ) from e
