"""The reference backend ("xla") through the backend test base (tests/_backend_base.py):
every call of the base against its float64 truth, NaN and inf where nothing may look,
vmap and bfloat16. The reference's own contract (zero rows, weights, dropout) is
tested in test_attention.py."""

from _backend_base import BackendTestBase


class TestXla(BackendTestBase):
    implementation = "xla"


def test_a_paged_call_gathers_each_sequence_once_not_each_query_row():
    """A mixed call of 512 query rows over 4 sequences of up to 4096 keys: the reference's
    compiled temporaries hold the sequences' keys and values once and one chunk of rows
    (PAGED_CHUNK_BYTES), not a copy of a sequence's keys per query row (1 GiB here)."""
    import jax
    import jax.numpy as jnp

    import nanoattn
    from nanoattn._backends.xla.reference import PAGED_CHUNK_BYTES

    B, T, M, page_size, K, N, H = 4, 512, 256, 16, 2, 4, 32
    f32, i32 = jnp.float32, jnp.int32
    shapes = (
        jax.ShapeDtypeStruct((T, N, H), f32), jax.ShapeDtypeStruct((B * M, page_size, K, H), f32),
        jax.ShapeDtypeStruct((B * M, page_size, K, H), f32), jax.ShapeDtypeStruct((B, M), i32),
        jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B + 1,), i32),
    )  # fmt: skip
    call = jax.jit(lambda *a: nanoattn.paged_attention(*a, implementation="xla"))
    temp = call.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
    per_row = T * M * page_size * K * H * 4 * 2  # a copy of its sequence's keys, values per row
    sequences = B * M * page_size * K * H * 4 * 2
    assert temp < 2 * (sequences + PAGED_CHUNK_BYTES) < per_row / 3, (temp, per_row)
