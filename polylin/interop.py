"""What code that wraps polylin needs from it: an array's library and device, polylin's checks.

A layer or a translation of another library's signatures (``polylin.compat``, ``polylin.torch``,
your own) resolves the namespace of its arguments, checks them in its own terms and then calls
polylin's public functions. These are the helpers polylin itself uses for that, so a wrapper
answers exactly as polylin does (the same namespace under ``torch.compile``, the same
``TypeError`` for a traced flag under ``jax.jit``, the same accumulation dtype).

Examples
--------
>>> import numpy as np
>>> from polylin.interop import array_namespace, device, is_array, work_dtype_for
>>> x = np.zeros((2, 3), dtype=np.float16)
>>> is_array(x), is_array(1.0), device(x)
(True, False, 'cpu')
>>> xp = array_namespace(x)
>>> work_dtype_for(xp, x.dtype) == xp.float32
True
"""

from __future__ import annotations

from ._backend.execution import check_static
from ._backend.namespace import array_namespace, device, is_array
from ._inputs.arrays import check_floating, is_real_number, work_dtype_for
from ._typing import Array, Namespace

__all__ = [
    "Array",
    "Namespace",
    "array_namespace",
    "check_floating",
    "check_static",
    "device",
    "is_array",
    "is_real_number",
    "work_dtype_for",
]
