"""Transfer lists of a paged step: the copy-on-write ``copies`` (whole pages) and the
slot ``moves`` (one token each, :mod:`.moves`) are both (n, 2) int32 lists of
``(source, target)`` units of the pool, ``(-1, -1)`` an unused entry. A unit outside
the pool, or two entries into one unit, is a bad list: one line when concrete; under
``jit`` the entry is dropped and the sequences holding its target's page are broken
(NaN, never written).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..._base.paged import held_pages


@dataclasses.dataclass(frozen=True)
class Transfers:
    """One kind of list: the argument's ``name`` ("copies"), its ``verb`` ("copy")
    and ``unit`` ("page"), whether its units are slots (``page_size`` a page) or whole
    pages, and ``pool``, the pool's size as an error says it (formatted with ``limit``,
    the units the pool holds)."""

    name: str
    verb: str
    unit: str
    slots: bool
    pool: str

    def per_page(self, page_size: int) -> int:
        """The units a page holds."""
        return page_size if self.slots else 1

    def faults(self, pairs, limit: int):
        """(n, 2) bool, traced or not: whether each used entry names a unit outside
        [0, ``limit``) (column 0), and whether another used entry has its target
        (column 1)."""
        source, target = pairs[:, 0], pairs[:, 1]
        unused = (source == -1) & (target == -1)
        outside = ~unused & ((source < 0) | (source >= limit) | (target < 0) | (target >= limit))
        same = (target[:, None] == target[None, :]) & ~unused[:, None] & ~unused[None, :]
        twice = (same & ~jnp.eye(pairs.shape[0], dtype=bool)).any(axis=1)
        return jnp.stack([outside, twice & ~outside], axis=1)

    def check(self, pairs, limit: int) -> None:
        """Raises ValueError for an entry naming a unit outside the pool, or two
        entries into one unit, when concrete (under ``jit``: :meth:`spoils`)."""
        if isinstance(pairs, jax.core.Tracer):
            return
        values = np.asarray(pairs)
        faults = np.asarray(self.faults(jnp.asarray(values), limit))
        if faults[:, 0].any():
            i = int(np.flatnonzero(faults[:, 0])[0])
            raise ValueError(
                f"{self.name}[{i}]={values[i].tolist()} names a {self.unit} outside "
                f"{self.pool.format(limit=limit)}; an unused entry is [-1, -1]"
            )
        if faults[:, 1].any():
            i, j = (int(n) for n in np.flatnonzero(values[:, 1] == values[faults[:, 1]][0, 1])[:2])
            raise ValueError(
                f"{self.name}[{i}] and {self.name}[{j}] both {self.verb} into {self.unit} "
                f"{int(values[i, 1])}; a {self.unit} takes one {self.verb} per step"
            )

    def spoils(self, pairs, page_table, kv_lengths, P: int, page_size: int):
        """(B,) bool: the sequences holding the page a faulty entry was to fill (their
        tokens are NaN under ``jit``, and never written)."""
        per_page = self.per_page(page_size)
        limit = P * per_page
        faulty = self.faults(pairs, limit).any(axis=1)
        target = pairs[:, 1]
        lost = faulty & (target >= 0) & (target < limit)  # (n,): a unit left unfilled
        held = held_pages(kv_lengths, page_size, page_table.shape[1])  # (B, M)
        pages = jnp.where(lost, target // per_page, -2)  # -2: no page (not RETURNED's -1)
        hits = (page_table[:, :, None] == pages[None, None, :]) & held[..., None]  # (B, M, n)
        return hits.any(axis=(1, 2))

    def sound(self, pairs, limit: int):
        """``(source, target)`` (n,) each of the used, sound entries; the others read
        unit 0 and write past the pool (``limit``: dropped)."""
        used = ~self.faults(pairs, limit).any(axis=1) & (pairs[:, 0] >= 0)
        return jnp.where(used, pairs[:, 0], 0), jnp.where(used, pairs[:, 1], limit)


# Copy-on-write copies of whole pages, and slot moves (an accepted tree path's tokens).
COPIES = Transfers("copies", "copy", "page", slots=False, pool="the pool (P={limit})")
MOVES = Transfers("moves", "move", "slot", slots=True,
                  pool="the pool's {limit} (P * page_size)")  # fmt: skip
