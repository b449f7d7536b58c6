"""Drop-in entry points for code written against other libraries' kernels.

- :mod:`polylin.compat.fla`: flash-linear-attention's ops (``chunk_gated_delta_rule``,
  ``chunk_kda``, ``chunk_gla``, ...) with fla's names, signatures, layouts and return values,
  computed by polylin on any array-API library.
- :mod:`polylin.compat.transformers`: ``use_polylin(model)`` points the Gated DeltaNet and Kimi
  Delta Attention layers of a transformers model at :mod:`polylin.compat.fla` (imports torch
  and transformers when called).

Both are thin translations: every number is computed by polylin's own functions.
"""

from ..compat import fla

__all__ = ["fla"]
