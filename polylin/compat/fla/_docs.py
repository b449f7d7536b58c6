"""The parameter descriptions that flash-linear-attention's ops share, written once.

:func:`fla_doc` replaces each line ``    <name>`` of a docstring by the description of that name
here (indented as a numpydoc parameter, return value or exception), so the twelve-odd ops of
:mod:`polylin.compat.fla` say the same things in the same words. It also writes the layout into
each op's first line (:data:`SUMMARY`): fla's ``(B, T, H, d)``, the layout that a head-first
``(B, H, T, d)`` array is mistaken for.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

__all__ = ["fla_doc"]

F = TypeVar("F", bound=Callable[..., object])

#: Descriptions by name: the first line is the numpydoc header, the others its text.
SHARED: dict[str, str] = {
    "beta": """beta : array
        The learning rate per token, ``(B, T, HV)`` (after the sigmoid).""",
    "cp_context": """cp_context : object, optional
        Context parallelism: not supported.""",
    "cu_seqlens": """cu_seqlens : array of int, optional
        Offsets ``[0, l1, l1 + l2, ..., T]`` of packed sequences (then ``B == 1``); read once on
        the host.""",
    "cu_seqlens_cpu": """cu_seqlens_cpu : array of int, optional
        The host copy of ``cu_seqlens`` (fla's): read instead of it when given.""",
    "disable_recompute": """disable_recompute : bool
        A memory/speed trade-off of fla: accepted, ignored.""",
    "final_state_h": """final_state : array or None
        ``(N, H, K, V)`` if ``output_final_state`` (float32 for 16-bit inputs).""",
    "final_state_hv": """final_state : array or None
        ``(N, HV, K, V)`` if ``output_final_state`` (float32 for 16-bit inputs).""",
    "initial_state_hv": """initial_state : array, optional
        The state to continue from, ``(N, HV, K, V)`` (``N``: the batch, or the number of
        sequences with ``cu_seqlens``).""",
    "initial_state_h": """initial_state : array, optional
        The state to continue from, ``(N, H, K, V)`` (``N``: the batch, or the number of
        sequences with ``cu_seqlens``).""",
    "initial_state_h_v_first": """initial_state : array, optional
        The state to continue from, ``(N, H, K, V)`` (``(N, H, V, K)`` with ``state_v_first``;
        ``N``: the batch, or the number of sequences with ``cu_seqlens``).""",
    "k": """k : array
        Keys, ``(B, T, H, K)``.""",
    "kwargs_state_layout": """**kwargs
        ``transpose_state_layout``: fla's deprecated name of ``state_v_first``; any other option
        raises ``NotImplementedError`` naming it.""",
    "raises_not_implemented": """NotImplementedError
        An option polylin does not compute, named in the message.""",
    "o_h": """o : array
        ``(B, T, H, V)``, the library, device and dtype of ``q``.""",
    "o_hv": """o : array
        ``(B, T, HV, V)``, the library, device and dtype of ``q``.""",
    "o_rwkv": """o : array
        ``(B, T, H, V)``, the library, device and dtype of ``r``.""",
    "output_final_state": """output_final_state : bool
        Return the state after the last token (else ``None``).""",
    "q_k": """q, k : array
        Queries and keys, ``(B, T, H, K)``.""",
    "r": """r : array
        Receptances (queries), ``(B, T, H, K)``.""",
    "reverse": """reverse : bool
        Scan from the end: not supported (``NotImplementedError`` when True).""",
    "safe_gate": """safe_gate : bool
        A speed hint of fla for bounded gates: accepted, ignored.""",
    "scale": """scale : float, optional
        Multiplies the queries; default ``K ** -0.5``.""",
    "state_v_first": """state_v_first : bool
        States stored value-first, ``(..., V, K)``.""",
    "state_v_first_hv": """state_v_first : bool
        States stored value-first, ``(N, HV, V, K)``.""",
    "beta_options": """use_beta_sigmoid_in_kernel, allow_neg_eigval : bool
        Not supported: pass ``sigmoid(beta)`` (or ``2 sigmoid(beta)``) as ``beta``.""",
    "use_qk_l2norm_in_kernel": """use_qk_l2norm_in_kernel : bool
        L2-normalize ``q`` and ``k`` first, ``x / sqrt(sum(x^2) + 1e-6)`` (fla's formula).""",
    "v_h": """v : array
        Values, ``(B, T, H, V)``.""",
    "v_hv": """v : array
        Values, ``(B, T, HV, V)``, ``HV`` a multiple of ``H`` (each query/key head serves
        ``HV // H`` consecutive value heads).""",
    "raises_shape_rules": """ValueError
        fla's shape rules: ``HV`` not a multiple of ``H``, ``B != 1`` or a state count that is
        not the number of sequences with ``cu_seqlens``.""",
    "w": """w : array
        Log decay per token, head and key channel, ``(B, T, H, K)`` (``<= 0``).""",
}


#: The start of every op's first line, as written (``{name}``: the op) and as it is shown.
SUMMARY_WRITTEN = "Compute fla's ``{name}``"
SUMMARY = "Compute fla's ``{name}`` on ``(B, T, H, d)`` inputs"


def fla_doc(function: F) -> F:
    """Expand the ``    <name>`` lines of ``function``'s docstring from :data:`SHARED`, state
    the layout in its first line (:data:`SUMMARY`), and name the module users import it from."""

    def expand(match: re.Match[str]) -> str:
        return "    " + SHARED[match.group(1)]

    doc = function.__doc__
    if doc:
        written = SUMMARY_WRITTEN.format(name=function.__name__)
        if not doc.startswith(written):
            raise ValueError(f"{function.__name__}'s docstring must start with {written!r}")
        doc = SUMMARY.format(name=function.__name__) + doc[len(written) :]
        function.__doc__ = re.sub(r"^    <(\w+)>$", expand, doc, flags=re.MULTILINE)
    function.__module__ = "polylin.compat.fla"
    return function
