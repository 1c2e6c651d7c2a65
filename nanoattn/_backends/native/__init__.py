"""The native CPU kernel: C++ through XLA's FFI (``attention.cc``), its build
(:mod:`.build`), its JAX binding with a custom VJP (:mod:`.kernel`) and the backend
interface (:mod:`.backend`)."""

from .backend import BACKEND as BACKEND
from .build import amx as amx
from .build import isa as isa
from .build import load as load
from .kernel import native_attention as native_attention
