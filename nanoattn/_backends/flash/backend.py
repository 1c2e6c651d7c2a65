"""``"flash"``: the blockwise kernel (:mod:`.kernel`), pure JAX, O(T) memory, any
platform; no dropout, and ``scale`` must be a Python number (it is part of the
kernel's static plan)."""

import jax

from ..._base.selection import dense_as_pages, paged_as_pages, read_selected
from ..._base.tree import tree_as_mask
from ..interface import NO_DROPOUT
from . import kernel as flash_kernel
from .paged import paged_flash_attention

# On CPU the kernel beats the reference from about this many score cells per
# batch row and head (T * S); measured with `nanoattn bench` (docs/performance.md).
CPU_MIN_CELLS = 256 * 256
# Off CPU (unmeasured here): above this many bytes of scores the kernel's
# O(T) memory wins when cuDNN cannot serve the call.
ACCELERATOR_MIN_SCORE_BYTES = 2**30


class Flash:
    name = "flash"
    priority = 1
    serves = frozenset({
        "mask", "bias", "is_causal", "window", "kv_lengths", "segment_ids", "logit_soft_cap",
        "mask_fn", "score_fn", "sinks", "page_table", "kv_scales", "value_width", "tree",
        "selection",
    })  # fmt: skip

    def unsupported(self, rules, dtype, dropout_rate: float) -> str | None:
        if dropout_rate > 0:
            return NO_DROPOUT
        if not rules.static_scale:
            return "the kernel needs a Python number for scale, not a traced array"
        return None

    def pays_off(self, rules, dtype) -> bool:
        cells = rules.T * rules.S
        if jax.default_backend() == "cpu":
            return cells >= CPU_MIN_CELLS
        return rules.B * rules.N * cells * 4 >= ACCELERATOR_MIN_SCORE_BYTES

    def __call__(self, query, key, value, rules, *, dropout_rate: float, dropout_rng,
                 tiles=None):  # fmt: skip
        if rules.key_indices is not None:  # only the selected keys: pages of one key
            return read_selected(self.paged, dense_as_pages, query, key, value, rules)
        forward_tiles, backward_tiles = (None, None) if tiles is None else tiles
        return flash_kernel.flash_attention(
            query, key, value, tree_as_mask(rules), forward_tiles=forward_tiles,
            backward_tiles=backward_tiles,
        )  # fmt: skip

    def paged(self, query, key_pages, value_pages, rules):
        if rules.key_indices is not None:
            return read_selected(self.paged, paged_as_pages, query, key_pages, value_pages,
                                 rules)  # fmt: skip
        return paged_flash_attention(query, key_pages, value_pages, tree_as_mask(rules))


BACKEND = Flash()
