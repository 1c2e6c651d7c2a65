"""``"xla"``: the reference (:mod:`.reference`), plain einsums over the full score
tensor. Always available, every rule and dropout; it defines the output contract every
other backend is tested against."""

from ..._base.numerics import softmax_dtype
from ..._base.quantized import dequantized_call
from ..._base.tree import tree_as_mask
from ..interface import EVERY_RULE
from . import reference


class Xla:
    name = "xla"
    priority = 0  # the automatic choice's fallback: it serves every call
    serves = EVERY_RULE
    forward_mode = True  # plain jax: jax.jvp, jacfwd and hessian differentiate it
    applies_sinks = True  # its softmax has them; other backends get them merged in

    def unsupported(self, rules, dtype, dropout_rate: float) -> str | None:
        return None

    def pays_off(self, rules, dtype) -> bool:
        return True

    def __call__(self, query, key, value, rules, *, dropout_rate: float, dropout_rng,
                 tiles=None):  # fmt: skip
        # quantized keys and values: dequantized first, the arithmetic kernels match
        key, value, rules = dequantized_call(key, value, rules, softmax_dtype(query.dtype))
        rules = tree_as_mask(rules)  # a token tree: its positions and ancestry as mask_fn
        return reference.attend(
            query, key, value, rules, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            return_residual=rules.return_residual,
        )  # fmt: skip

    def paged(self, query, key_pages, value_pages, rules):
        key_pages, value_pages, rules = dequantized_call(
            key_pages, value_pages, rules, softmax_dtype(query.dtype)
        )
        rules = tree_as_mask(rules)
        return reference.paged_attend(
            query, key_pages, value_pages, rules, return_residual=rules.return_residual
        )

    def weights(self, query, key, rules):
        """The normalised weights (B, N, T, S) (``nanoattn.attention_weights``)."""
        return reference.weights(query, key, tree_as_mask(rules))


BACKEND = Xla()
