"""The slot arithmetic of rolling caches (nanoattn/_layers/caches/rolling.py) against a literal
simulation of a ring buffer: every write, every capacity, sink count and length."""

import numpy as np
import pytest

from nanoattn._layers import positional
from nanoattn._layers.caches import rolling


def simulated(end, capacity, sink_tokens):
    """Writes positions 0 .. end - 1 one by one into a list of slots, as a ring buffer
    that keeps the first ``sink_tokens`` positions: which position each slot holds."""
    slots = [-1] * capacity
    for j in range(end):
        if j < sink_tokens:
            slots[j] = j
        else:
            slots[sink_tokens + (j - sink_tokens) % (capacity - sink_tokens)] = j
    return slots


@pytest.mark.parametrize("capacity, sink_tokens", [(1, 0), (5, 0), (7, 2), (8, 3), (4, 3)])
def test_slot_positions_and_slots_equal_a_literal_ring_buffer(capacity, sink_tokens):
    ends = np.arange(0, 4 * capacity + 3)
    got = np.asarray(rolling.slot_positions(ends, capacity, sink_tokens))
    for end, row in zip(ends, got):
        assert row.tolist() == simulated(int(end), capacity, sink_tokens), end
    for j in range(3 * capacity):
        slot = int(rolling.slot_of(j, capacity, sink_tokens))
        assert simulated(j + 1, capacity, sink_tokens)[slot] == j


def test_within_the_chunk_limit_no_query_of_a_chunk_loses_a_key_it_sees():
    # C = 10 slots, window 4, 2 sinks: chunks of up to 4 tokens. Every key a query of the
    # chunk may see is still in the cache after the chunk is written; one token more and
    # some query would need an overwritten key.
    C, W, S0 = 10, 4, 2
    limit = rolling.chunk_limit(C, W, S0)
    assert limit == 4
    for L, fits in ((limit, True), (limit + 1, False)):
        lost = False
        for start in range(0, 40):
            end = start + L
            held = set(simulated(end, C, S0))
            for p in range(start, end):
                needed = {j for j in range(p + 1) if p - j <= W or j < S0}
                lost |= not needed <= held
        assert lost != fits, L


def test_visibility_is_causal_windowed_and_keeps_the_sinks():
    q = np.array([[10]])
    keys = np.array([[-1, 0, 1, 2, 5, 6, 10, 11]])
    got = np.asarray(positional.visible(q, keys, window=4, sink_tokens=2))
    assert got.tolist() == [[False, True, True, False, False, True, True, False]]
