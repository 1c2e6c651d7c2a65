"""ONNX Runtime's ``GroupQueryAttention`` (the ``com.microsoft`` contrib operator) as a
peer of the decode sweep, when onnxruntime and onnx are importable (the ``bench``
extra; never a runtime dependency).

It has no page table: it reads a dense cache, ``past_key`` and ``past_value`` (B, K,
capacity, H) (BNSH), and writes the step's own key and value (B, 1, K H) into it at
position ``seqlens_k`` (the total length minus 1, per sequence). So the step is built
from the same numbers as nanoattn's: each sequence's first L - 1 keys and values of the
case's pages in the cache, its L-th as the step's new key and value, capacity the
longest L. A one-node model made with ``onnx.helper``; the cache bound by an IOBinding
as both input (past) and output (present), so that ORT updates it in place instead of
copying it (its ``past_present_share_buffer`` path). ``local_window_size=W`` would be
nanoattn's ``window=(W - 1, 0)``; the sweep has no window. ORT's CPU kernel takes
float32 and float16: the sweep runs it in float32 only, with a thread per core.
"""

import numpy as np

from ._bandwidth import cores
from ._optional import float32_and_one_width, installed, missing

INSTALL = "pip install 'nanoattn[bench]' (or pip install onnxruntime onnx)"


def available() -> str | None:
    """None when onnxruntime and onnx can be used, else why not."""
    why = f"onnxruntime is not installed (an optional peer: {INSTALL})"
    return missing(("onnx", "onnxruntime"), why)


def version() -> str | None:
    module = installed("onnxruntime")
    return None if module is None else module.__version__


def unsupported(case, dtype: str) -> str | None:
    """Why the peer does not run ``case`` in ``dtype`` here, or None."""
    kernels = " (its CPU kernel: float32, float16)"
    return float32_and_one_width(case, dtype, "GroupQueryAttention", kernels)


def model(N: int, K: int, H: int, window: int | None = None) -> bytes:
    """A one-node float32 model: GroupQueryAttention of N query heads on K key/value
    heads of width H, scale H^-1/2, ``local_window_size=window`` (None: the whole
    cache)."""
    from onnx import TensorProto, helper

    f, i = TensorProto.FLOAT, TensorProto.INT32
    attributes = dict(num_heads=N, kv_num_heads=K, scale=H**-0.5)
    if window is not None:
        attributes["local_window_size"] = window
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k",
             "total_sequence_length"]  # fmt: skip
    outputs = ["output", "present_key", "present_value"]
    node = helper.make_node("GroupQueryAttention", names, outputs, domain="com.microsoft",
                            **attributes)  # fmt: skip
    cache = ["B", K, "S", H]
    shapes = {"query": ["B", 1, N * H], "key": ["B", 1, K * H], "value": ["B", 1, K * H],
              "past_key": cache, "past_value": cache, "output": ["B", 1, N * H],
              "present_key": cache, "present_value": cache}  # fmt: skip
    graph = helper.make_graph(
        [node], "decode",
        [helper.make_tensor_value_info(n, f, shapes[n]) for n in names[:5]]
        + [helper.make_tensor_value_info("seqlens_k", i, ["B"]),
           helper.make_tensor_value_info("total_sequence_length", i, [])],
        [helper.make_tensor_value_info(n, f, shapes[n]) for n in outputs],
    )  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def dense_step(inputs) -> dict:
    """The case's numbers as GroupQueryAttention's operands (float32): query (B, 1, N H),
    the new key and value (B, 1, K H), the caches (B, K, capacity, H) holding the L - 1
    keys and values before, seqlens_k (B,) and total_sequence_length."""
    lengths = inputs.lengths
    B, N, H = inputs.query.shape
    K, capacity = inputs.key_pages.shape[2], int(lengths.max())
    past = {name: np.zeros((B, K, capacity, H), np.float32) for name in ("key", "value")}
    new = {name: np.zeros((B, 1, K * H), np.float32) for name in ("key", "value")}
    for b in range(B):
        n = int(lengths[b])
        for name, x in zip(("key", "value"), inputs.dense(b)):  # (L, K, H)
            past[name][b, :, : n - 1] = x[: n - 1].transpose(1, 0, 2)
            new[name][b, 0] = x[n - 1].reshape(-1)
    return {
        "query": np.asarray(inputs.query, np.float32).reshape(B, 1, N * H),
        "key": new["key"], "value": new["value"],
        "past_key": past["key"], "past_value": past["value"],
        "seqlens_k": (lengths - 1).astype(np.int32),
        "total_sequence_length": np.array(capacity, np.int32),
    }  # fmt: skip


def make_run(inputs, window: int | None = None):
    """``(run, output)``: ``run()`` one decoding step of ``inputs`` (an
    :class:`~._decode_cases.Inputs`) through GroupQueryAttention, the cache bound in
    place; ``output()`` the last step's output (B, N, H) float32."""
    import onnxruntime as ort

    B, N, H = inputs.query.shape
    K = inputs.key_pages.shape[2]
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = cores(), 1
    session = ort.InferenceSession(model(N, K, H, window), options,
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    operands = dense_step(inputs)
    binding = session.io_binding()
    caches = {}
    for name, x in operands.items():
        if name.startswith("past_"):
            caches[name] = ort.OrtValue.ortvalue_from_numpy(x)
            binding.bind_ortvalue_input(name, caches[name])
        else:
            binding.bind_cpu_input(name, x)
    binding.bind_output("output")
    for name in ("key", "value"):  # present is past: updated in place, not copied
        binding.bind_ortvalue_output(f"present_{name}", caches[f"past_{name}"])

    def run():
        session.run_with_iobinding(binding)

    def output():
        return binding.copy_outputs_to_cpu()[0].reshape(B, N, H)

    return run, output
