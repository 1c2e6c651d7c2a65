"""Pytest plugin: flax's attention layers default to ``nanoattn.flax_attention_fn``.

Loaded by ``run.py`` (``-p flax_adapter_plugin``) around flax's own attention test files,
never by the project's test suite. It sets the default ``attention_fn`` of
``flax.linen.MultiHeadDotProductAttention``, ``flax.linen.MultiHeadAttention``
and ``flax.nnx.MultiHeadAttention`` to the adapter (wrapped to count its
calls), checks that new layers really get it, and fails the session if the
adapter was never called, so that a green run cannot come from flax's own
function. The summary line says how many calls the adapter served and how
many it handed over to flax.
"""

import functools
import inspect

import flax.linen as nn
import pytest
from flax import nnx

import nanoattn
from nanoattn._interop import flax_attention_fn as flax_attention_fn_module

CALLS = {"adapter": 0, "handed_over": 0}


@functools.wraps(nanoattn.flax_attention_fn)  # linen reads the signature through __wrapped__
def counted_attention_fn(*args, **kwargs):
    CALLS["adapter"] += 1
    return nanoattn.flax_attention_fn(*args, **kwargs)


def _counted_hand_over(hand_over):
    @functools.wraps(hand_over)
    def wrapper(*args, **kwargs):
        CALLS["handed_over"] += 1
        return hand_over(*args, **kwargs)

    return wrapper


def set_default_attention_fn(cls, fn) -> None:
    """Makes ``fn`` the default ``attention_fn`` of the layer class ``cls``: in its
    ``__init__`` (linen's dataclass one, or NNX's) and, for linen, its dataclass field."""
    init = inspect.unwrap(cls.__init__)
    if init.__kwdefaults__ and "attention_fn" in init.__kwdefaults__:
        init.__kwdefaults__["attention_fn"] = fn
    else:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = inspect.signature(init).parameters.values()
        positional = [p.name for p in params if p.kind in kinds]
        defaults = list(init.__defaults__)
        defaults[positional.index("attention_fn") - (len(positional) - len(defaults))] = fn
        init.__defaults__ = tuple(defaults)
    field = getattr(cls, "__dataclass_fields__", {}).get("attention_fn")
    if field is not None:
        field.default = fn
        cls.attention_fn = fn


def pytest_configure(config):
    for cls in (nn.MultiHeadDotProductAttention, nn.MultiHeadAttention, nnx.MultiHeadAttention):
        set_default_attention_fn(cls, counted_attention_fn)
    flax_attention_fn_module._hand_over = _counted_hand_over(flax_attention_fn_module._hand_over)
    layers = [
        nn.MultiHeadDotProductAttention(num_heads=1),
        nn.MultiHeadAttention(num_heads=1),
        nnx.MultiHeadAttention(num_heads=1, in_features=2, rngs=nnx.Rngs(0)),
    ]
    for layer in layers:
        if layer.attention_fn is not counted_attention_fn:
            raise pytest.UsageError(
                f"could not make nanoattn.flax_attention_fn the default of {type(layer)}"
            )


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(
        f"nanoattn.flax_attention_fn: {CALLS['adapter']} calls, "
        f"{CALLS['handed_over']} handed over to flax"
    )


def pytest_sessionfinish(session, exitstatus):
    if CALLS["adapter"] == 0 and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
