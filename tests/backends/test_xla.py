"""The reference backend ("xla") through the backend test base (tests/_backend_base.py):
every call of the base against its float64 truth, NaN and inf where nothing may look,
vmap and bfloat16. The reference's own contract (zero rows, weights, dropout) is
tested in test_attention.py."""

from _backend_base import BackendTestBase


class TestXla(BackendTestBase):
    implementation = "xla"
