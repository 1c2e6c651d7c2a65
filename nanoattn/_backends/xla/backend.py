"""``"xla"``: the reference (:mod:`nanoattn._backends.xla.reference`), plain einsums over the full
score tensor. Always available, every feature (dropout included); it defines the
output contract every other backend is tested against."""

from . import reference


class Xla:
    name = "xla"
    priority = 0  # the automatic choice's fallback: it serves every call
    applies_sinks = True  # its softmax has them; other backends get them merged in

    def unsupported(self, spec, dtype, dropout_rate: float) -> str | None:
        return None

    def pays_off(self, spec, dtype) -> bool:
        return True

    def __call__(self, query, key, value, spec, *, dropout_rate: float, dropout_rng):
        return reference.attend(
            query, key, value, spec, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            return_residual=spec.return_residual,
        )  # fmt: skip


BACKEND = Xla()
