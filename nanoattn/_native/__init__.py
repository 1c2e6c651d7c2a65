"""The native CPU kernel: C++ through XLA's FFI (``attention.cc``), its build
(:mod:`._build`) and its JAX binding with a custom VJP (:mod:`._kernel`)."""

from ._build import isa as isa
from ._build import load as load
from ._kernel import native_attention as native_attention
