"""The backend registry (nanoattn/registry.py) and the dispatcher's use of it:
a backend is one object with the interface of nanoattn._backends.Backend, and
adding one is a module plus one registry entry. Here a toy backend (the
reference, counting its calls) is registered at run time and served through
every entry point that takes ``implementation=``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nanoattn
from nanoattn._backends import dispatch, interface, registry
from nanoattn.linen import AttentionConfig, CausalSelfAttention

from _backend_base import BackendTestBase


class Toy:
    """The reference under another name, serving causal calls only."""

    name = "toy"
    priority = None  # never taken by the automatic choice
    serves = interface.EVERY_RULE

    def __init__(self):
        self.calls = 0

    def unsupported(self, spec, dtype, dropout_rate):
        return None if spec.is_causal else "it serves causal calls only"

    def pays_off(self, spec, dtype):
        return True

    def __call__(self, query, key, value, spec, *, dropout_rate, dropout_rng):
        self.calls += 1
        reference = registry.get("xla")
        return reference(
            query, key, value, spec, dropout_rate=dropout_rate, dropout_rng=dropout_rng
        )

    def paged(self, query, key_pages, value_pages, spec):
        self.calls += 1
        return registry.get("xla").paged(query, key_pages, value_pages, spec)


@pytest.fixture
def toy():
    backend = Toy()
    registry.register(backend)
    yield backend
    registry.unregister("toy")


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 7, 6, 8))
    k, v = (jax.random.normal(key, (2, 7, 3, 8)) for key in keys[1:])
    return q, k, v


def test_a_registered_backend_serves_dot_product_attention(toy):
    q, k, v = _qkv()
    out = nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="toy")
    want = nanoattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    assert toy.calls == 1
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match=r"^implementation='toy' cannot serve this call: it "
                       r"serves causal calls only$"):  # fmt: skip
        nanoattn.dot_product_attention(q, k, v, implementation="toy")


def test_a_paged_call_reaches_a_backends_paged_method_or_is_refused(toy, monkeypatch):
    """Paged calls go to ``backend.paged`` with the pool's pages, never to ``__call__``;
    a backend that lists the page table but has no ``paged`` is refused in one line."""
    q = jax.random.normal(jax.random.key(3), (4, 6, 8))
    pages = jax.random.normal(jax.random.key(4), (5, 2, 3, 8))
    arrays = (q, pages, pages, jnp.array([[3, 1]]), jnp.array([4]), jnp.array([0, 4]))
    out = nanoattn.paged_attention(*arrays, implementation="toy")
    assert toy.calls == 1
    np.testing.assert_array_equal(out, nanoattn.paged_attention(*arrays, implementation="xla"))
    monkeypatch.delattr(Toy, "paged")
    message = r"^implementation='toy' cannot serve this call: it lists the page table in "
    with pytest.raises(ValueError, match=message + r"serves but has no paged\(...\) method$"):
        nanoattn.paged_attention(*arrays, implementation="toy")


def test_a_registered_backend_serves_a_layer_through_its_config(toy):
    config = AttentionConfig(d_model=48, n_heads=6, n_kv_heads=3, implementation="toy")
    x = jax.random.normal(jax.random.key(1), (2, 7, 48))
    layer = CausalSelfAttention(config)
    params = layer.init(jax.random.key(2), x, deterministic=True)
    calls = toy.calls
    y = layer.apply(params, x[:, :5], deterministic=True)  # another length: traced anew
    assert toy.calls == calls + 1
    plain = CausalSelfAttention(AttentionConfig(d_model=48, n_heads=6, n_kv_heads=3))
    np.testing.assert_allclose(y, plain.apply(params, x[:, :5], deterministic=True), atol=1e-6)


def test_the_automatic_choice_never_takes_a_backend_without_priority(toy):
    q, k, v = _qkv()
    spec = nanoattn._base.rules.Rules.make(q, k, v, is_causal=True)
    assert dispatch.choose(None, spec, jnp.float32, 0.0) != "toy"
    nanoattn.dot_product_attention(q, k, v, is_causal=True)
    assert toy.calls == 0


def test_names_come_from_one_place(toy):
    assert registry.names() == ("xla", "flash", "native", "cudnn", "toy")
    assert registry.BUILT_IN == ("xla", "flash", "native", "cudnn")
    message = r"^implementation must be one of 'xla', 'flash', 'native', 'cudnn', 'toy' or None"
    for call in (
        lambda: nanoattn.dot_product_attention(*_qkv(), implementation="tiny"),
        lambda: AttentionConfig(d_model=48, n_heads=6, implementation="tiny"),
        lambda: nanoattn.flax_attention_fn(*_qkv(), implementation="tiny"),
    ):
        with pytest.raises(ValueError, match=message + r", got 'tiny'$"):
            call()
    with pytest.raises(ValueError, match=r"^a backend called 'toy' is already registered$"):
        registry.register(Toy())


def test_an_unregistered_backend_is_refused_again():
    registry.register(Toy())
    registry.unregister("toy")
    with pytest.raises(ValueError, match=r"implementation must be one of 'xla', 'flash', "
                       r"'native', 'cudnn' or None, got 'toy'$"):  # fmt: skip
        AttentionConfig(d_model=48, n_heads=6, implementation="toy")


@pytest.mark.parametrize("name", registry.BUILT_IN)
def test_every_built_in_backend_has_the_interface(name):
    backend = registry.get(name)
    assert backend.name == name
    assert isinstance(backend.priority, int)
    for method in ("unsupported", "pays_off", "__call__"):
        assert callable(getattr(backend, method))
    assert callable(getattr(backend, "paged", None)) == ("page_table" in backend.serves)
    assert backend.serves <= interface.EVERY_RULE
    assert set(interface.Backend.__annotations__) == {"name", "priority", "serves"}


class TestToyRunsTheBackendTestBase(BackendTestBase):
    """A backend registered at run time runs the backend test base unchanged."""

    implementation = "toy"

    @pytest.fixture(autouse=True)
    def registered(self):
        registry.register(Toy())
        yield
        registry.unregister("toy")


def test_the_automatic_choice_ranks_by_priority():
    ranked = [backend.name for backend in dispatch._ranked()]
    assert ranked == ["cudnn", "native", "flash", "xla"]
