"""``"flash"``: the blockwise kernel in pure JAX (:mod:`.kernel`), its static plan
(:mod:`.plan`) and block schedules (:mod:`.schedule`), behind the backend interface
(:mod:`.backend`)."""

from .backend import BACKEND as BACKEND
