"""PyTorch's scaled_dot_product_attention as a peer, when torch is importable.

torch is an optional benchmark extra, never a runtime dependency.
"""

import numpy as np

from ._optional import installed, missing


def available() -> str | None:
    """None when torch can be used, else why not."""
    why = (
        "torch is not installed (an optional peer, in no extra of nanoattn: pip install "
        "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, the CPU build)"
    )
    return missing(("torch",), why)


def make_run(q, k, v, backward: bool, dtype: str):
    """A zero-argument function running torch SDPA once on these inputs."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def tensor(x):  # (B, T, N, H) -> torch's (B, N, T, H)
        return torch.tensor(np.asarray(x, np.float32)).to(torch_dtype).transpose(1, 2)

    tq, tk, tv = (tensor(x).contiguous().requires_grad_(backward) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        if backward:
            out = sdpa(tq, tk, tv, is_causal=True)
            out.backward(torch.ones_like(out))
            tq.grad = tk.grad = tv.grad = None
        else:
            with torch.no_grad():
                sdpa(tq, tk, tv, is_causal=True)

    return run


def version() -> str | None:
    torch = installed("torch")
    return None if torch is None else f"{torch.__version__} ({torch.get_num_threads()} threads)"
