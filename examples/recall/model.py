"""The decoder: token embedding, pre-norm blocks (RMSNorm, nanoattn's causal
self-attention with RoPE and grouped-query heads, RMSNorm, MLP), a final RMSNorm and
the unembedding, in Flax NNX.

Axis letters (docs/conventions.md): B batch, T time, D model width, V vocabulary.

The model decodes through nanoattn's KV cache: ``model.init_cache(batch, max_len)``
gives every attention layer its cache, and ``model(chunk, decode=True, lengths=...)``
threads a right-padded chunk through all of them, each row at its own position. That
is the protocol of ``nanoattn.verify.decoders.nnx``, so the whole model is checked
with one line.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import nanoattn
from nanoattn.nnx import AttentionConfig, CausalSelfAttention


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the decoder.

    Attributes:
      vocab: V, the vocabulary size.
      d_model: D, the model width.
      n_heads, n_kv_heads: query heads and key/value heads (grouped-query attention).
      n_layers: the number of blocks.
      mlp_ratio: the MLP's hidden width is ``mlp_ratio * d_model``.
      dropout: the rate of dropout on the attention weights and on each block's two
        residual branches; only in training (``deterministic=False``).
      rope_base: the RoPE frequency base.
      qk_norm: RMS-normalise every query and key head (a learned scale) before RoPE.
      global_rope: False: the global blocks take no rotary embedding (NoPE), so their
        lookup is by content alone and reads contexts longer than the training
        sequences (the local blocks keep RoPE: they only tell the previous token).
      local_window: None, or w: blocks 0, 2, 4, ... (never the last) attend only to
        the w tokens before each token and itself, as Gemma's local layers; the
        others attend to the whole context. A local first block finds the previous
        token at once, the first step of looking a key up.
      implementation: nanoattn's attention backend (``AttentionConfig``); the
        reference ``"xla"`` is the fastest for training at these sizes on CPU, None
        chooses. Kept in the checkpoint; ``serve`` does not inherit it (its own
        ``--implementation``, by default None: engine.with_implementation).
    """

    vocab: int
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    mlp_ratio: int = 2
    dropout: float = 0.0
    rope_base: float = 10000.0
    qk_norm: bool = True
    global_rope: bool = True
    local_window: int | None = 1
    implementation: str | None = "xla"

    def __post_init__(self):
        # At construction, not at the first compiled call: nanoattn's AttentionConfig
        # checks the heads, the head width RoPE needs, the rate and the backend (its
        # messages name fields as ``name=value``, as these do).
        for name in ("vocab", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.local_window is not None and self.local_window < 0:
            raise ValueError(f"local_window={self.local_window} must be >= 0 or None")
        for layer in range(self.n_layers):
            self.attention(layer)

    def attention(
        self, layer: int, page_size: int | None = None, kv_cache_dtype: str | None = None,
        page_selection: int | None = None,
    ) -> AttentionConfig:  # fmt: skip
        """The attention of block ``layer``: local in the even blocks but the last;
        with ``page_size``, decoding through a paged KV cache (the engine's); with
        ``kv_cache_dtype`` (``"int8"``, ``"float8_e4m3fn"``), a quantized cache; with
        ``page_selection`` k, a global block's decode steps read k pages and their last
        (selection.py; a local block reads its window)."""
        local = self.local_window is not None and layer % 2 == 0 and layer < self.n_layers - 1
        return AttentionConfig(
            window=(self.local_window, 0) if local else None,
            page_size=page_size,
            kv_cache_dtype=kv_cache_dtype,
            page_selection=None if local else page_selection,
            implementation=self.implementation,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            rope_base=self.rope_base if local or self.global_rope else None,
            dropout=self.dropout,
            qk_norm=self.qk_norm,
        )


class MLP(nnx.Module):
    """``down(gelu(up(x)))``: (B, T, D) -> (B, T, D)."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d_model, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``, each branch with dropout."""

    def __init__(
        self, config: ModelConfig, layer: int, *, page_size=None, kv_cache_dtype=None,
        page_selection=None, rngs: nnx.Rngs,
    ):  # fmt: skip
        D = config.d_model
        self.attn_norm = nnx.RMSNorm(D, rngs=rngs)
        attention = config.attention(layer, page_size, kv_cache_dtype, page_selection)
        self.attn = CausalSelfAttention(attention, deterministic=True, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(D, rngs=rngs)
        self.mlp = MLP(D, config.mlp_ratio * D, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, x, *, mask, decode, lengths, pages, deterministic, rngs, tree_parents=None):
        h = self.attn(
            self.attn_norm(x),
            mask=mask,
            decode=decode,
            lengths=lengths,
            pages=pages,
            tree_parents=tree_parents,
            deterministic=deterministic,
            rngs=rngs,
        )
        x = x + self.dropout(h, deterministic=deterministic, rngs=rngs)
        h = self.mlp(self.mlp_norm(x))
        return x + self.dropout(h, deterministic=deterministic, rngs=rngs)


class Decoder(nnx.Module):
    """A decoder-only transformer: token ids (B, T) -> logits (B, T, V).

    ``page_size`` gives every layer a paged KV cache (the engine's), ``kv_cache_dtype``
    a quantized one (``"int8"``, ``"float8_e4m3fn"``; quantized.py), ``page_selection``
    (with ``page_size``) page selection in the global layers (selection.py); the
    parameters are the same whatever the cache.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = Decoder(ModelConfig(vocab=11, d_model=32, n_layers=1), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 5), jnp.int32)).shape
      (2, 5, 11)
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        page_size: int | None = None,
        kv_cache_dtype: str | None = None,
        page_selection: int | None = None,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.embed = nnx.Embed(config.vocab, config.d_model, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(
                    config,
                    i,
                    page_size=page_size,
                    kv_cache_dtype=kv_cache_dtype,
                    page_selection=page_selection,
                    rngs=rngs,
                )
                for i in range(config.n_layers)
            ]
        )
        self.norm = nnx.RMSNorm(config.d_model, rngs=rngs)

    def rebuilt(self, config: ModelConfig | None = None, **options) -> "Decoder":
        """This decoder's parameters in a new one of ``config`` (None: this one's) with
        ``options`` (``page_size``, ``kv_cache_dtype``, ``page_selection``), in
        evaluation mode: the same weights behind another cache or backend."""
        other = Decoder(self.config if config is None else config, **options, rngs=nnx.Rngs(0))
        nnx.update(other, nnx.state(self, nnx.Param))
        other.eval()
        return other

    def init_cache(self, batch: int, max_len: int) -> None:
        """An empty KV cache of ``max_len`` tokens for ``batch`` rows in every layer
        (with ``page_size``: a pool of ``max_len / page_size`` pages that any number
        of sequences share, ``batch`` unused)."""
        for block in self.blocks:
            block.attn.init_cache(batch, max_len)

    def accept(self, kept) -> None:
        """Every layer keeps the accepted path of the last call's token tree: row b the
        tokens ``kept[b]`` (int (B, A), a root-to-leaf path in order, then -1s), the rest
        taken back (nanoattn's ``module.accept``; a slot cache: not with ``page_size``,
        whose allocator accepts)."""
        for block in self.blocks:
            block.attn.accept(kept)

    def __call__(
        self,
        tokens,
        *,
        valid=None,
        decode: bool = False,
        lengths=None,
        pages=None,
        tree_parents=None,
        deterministic: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """The logits of the next token at every position.

        Args:
          tokens: int (B, T); with ``decode=True`` the next chunk of every row.
          valid: optional bool (B, T), True at real tokens: no token attends to a
            padded one (left or right padding). Not with ``decode=True``.
          decode: write the chunk into every layer's cache (``init_cache`` first)
            and attend over everything cached.
          lengths: only with ``decode=True``: optional int (B,), the real tokens of
            each row of a right-padded chunk.
          pages: only with ``decode=True`` and a model built with ``page_size``: the
            step's ``nanoattn.PagedBatch`` (``PageAllocator.batch``); tokens are then
            (1, Tq), the new tokens of many sequences token-major.
          tree_parents: only with ``decode=True``: optional int, tokens' shape: each
            chunk a token tree (speculative decoding: each token's parent's index in
            its chunk, -1 for the last token cached), as nanoattn's layers take it;
            keep the accepted path with :meth:`accept`.
          deterministic: False in training: dropout on, drawn from ``rngs``.
          rngs: ``nnx.Rngs(dropout=key)``, needed when dropout is on.

        Returns:
          float32 logits (B, T, V).
        """
        if decode and valid is not None:
            raise ValueError("valid is for a full forward; when decoding, pass lengths")
        mask = None if valid is None else nanoattn.padding_mask(jnp.asarray(valid, bool))
        x = self.embed(tokens)  # (B, T, D)
        for block in self.blocks:
            x = block(
                x,
                mask=mask,
                decode=decode,
                lengths=lengths,
                pages=pages,
                tree_parents=tree_parents,
                deterministic=deterministic,
                rngs=rngs,
            )
        return self.embed.attend(self.norm(x))  # (B, T, V): the embedding, transposed
