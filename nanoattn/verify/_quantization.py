"""The quantization check of :func:`nanoattn.verify.check_decoding`: a decoder whose
cache is quantized (int8, float8) decodes with an error of its own, which the check's
tolerance (``atol``) admits; this check says how large it is, next to the error the
same model makes with a float cache.

Given the same model with a float cache (``float_cache``: its ``init`` and ``step``)
and, optionally, a reference forward in higher precision (``reference(x) -> y``, the
full forward in float64; else the decoder's own ``full``), every chunking of the cache
equivalence check is decoded through both caches, and two deviations are measured
feature by feature (:func:`~._leaks.per_feature`):

* the quantized decode against the float decode: the quantization's own error,
  within the check's tolerance;
* the float decode against the reference: the float cache's error (float rounding,
  about 1e-7 relative in float32), within the tolerance a float decoder gets by
  default (1e-5, or 3e-2 for 16-bit outputs, times the largest output, at least 1).

So a report shows what quantizing costs beside what the float cache already costs, and
a float cache that is itself wrong fails the check instead of hiding in the larger
tolerance.
"""

from ._inputs import as_features
from ._leaks import Leaks, per_feature
from ._report import CheckResult

NAME = "quantization error"


def check_quantization(
    decode, float_init, float_step, reference, x, y, decoded: dict, runs: dict, tol: float,
    float_tol: float,
) -> CheckResult:  # fmt: skip
    """The check: ``decode(init, step, x, sizes)`` decodes x through a fresh state in
    chunks of ``sizes``; ``decoded[name]`` is the quantized decoder's output (B, T, F)
    for each chunking ``runs[name]``; y (B, T, F) is its ``full(x)``; ``reference`` is
    None (then y is the reference) or a function of x. Returns a :class:`CheckResult`
    whose ``worst`` is the quantized decode's largest deviation from the float decode
    and whose ``data`` holds both errors."""
    if reference is None:
        ref, ref_name = y, "full forward"
    else:
        ref, ref_name = as_features(reference(x), x.shape, "reference"), "float64 reference"
    quantized, floating = Leaks(tol), Leaks(float_tol)
    for name, sizes in runs.items():
        float_decoded = decode(float_init, float_step, x, sizes)
        quantized.add(
            per_feature(decoded[name], float_decoded),
            {"chunking": name},
            (),
            "position {position} of row {batch} (feature {feature}): the quantized cache's "
            f"decode differs from the float cache's by {{deviation:.3g}}, decoding {name}",
        )
        floating.add(
            per_feature(float_decoded, ref),
            {"chunking": name},
            (),
            "position {position} of row {batch} (feature {feature}): the float cache's "
            f"decode differs from the {ref_name} by {{deviation:.3g}}, decoding {name}",
        )
    data = {
        "quantized_vs_float": quantized.worst,
        "float_vs_reference": floating.worst,
        "reference": ref_name,
        "tolerance": tol,
        "float_tolerance": float_tol,
    }
    both = (
        f"the quantized cache's decode differs from the float cache's of the same model by "
        f"at most {quantized.worst:.3g} (tolerance {tol:.3g}); the float cache's from the "
        f"{ref_name} by at most {floating.worst:.3g} (tolerance {float_tol:.3g}); "
        f"{len(runs)} chunking{'s' if len(runs) > 1 else ''}"
    )
    failed = [leaks.first for leaks in (quantized, floating) if leaks.first is not None]
    if not failed:
        return CheckResult(NAME, True, both, quantized.worst, data=data)
    _, size, where, sentence = failed[0]
    data["first"] = where | {"deviation": size}
    return CheckResult(NAME, False, f"{sentence}; {both}", quantized.worst, where, data=data)
