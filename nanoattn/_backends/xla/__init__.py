"""``"xla"``: the reference kernel (:mod:`.reference`) behind the backend interface
(:mod:`.backend`)."""

from .backend import BACKEND as BACKEND
