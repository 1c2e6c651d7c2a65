"""The cuDNN backend through the backend test base (tests/_backend_base.py): on a
machine without an NVIDIA GPU every call is skipped with the backend's reason, and
the rules it does not serve are still refused in one line."""

from _backend_base import BackendTestBase


class TestCudnn(BackendTestBase):
    implementation = "cudnn"
