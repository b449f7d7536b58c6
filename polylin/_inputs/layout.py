"""Where the time axis is: the ``seq_axis`` keyword of the entry points.

Every algorithm works on the *standard layout* ``(..., T, d)``: the time axis second to last,
the feature axis last, every other axis a batch axis. An entry point that takes ``seq_axis``
moves that axis in with :meth:`SequenceLayout.to_standard` and the output's time axis back out
with :meth:`SequenceLayout.restore`; nothing else changes. The moves are ``permute_dims``: a
view on NumPy and PyTorch (the chunked form's reshapes then copy the inputs once), a transpose
that XLA fuses on JAX. ``docs/getting_started.md`` gives the measured cost.

With ``seq_axis=1`` and ``(batch, T, heads, d)`` inputs, the standard layout is
``(batch, heads, T, d)``: the state's leading dimensions are the inputs' without T and the
feature axis, in their order.

An entry point adopts ``seq_axis`` with two lines, and passes ``layout`` to
:func:`polylin._inputs.validation.check_mask` so that masks follow the mask rule in the
caller's layout::

    layout, q, k, v = standard_layout(seq_axis, q=q, k=k, v=v)  # first thing
    ...
    return layout.restore(out)  # every output with a T axis
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

from .._backend.execution import check_static
from .._backend.namespace import is_array
from .arrays import is_real_number, namespace_of

__all__ = ["DEFAULT_SEQ_AXIS", "SequenceLayout", "standard_layout"]

#: The default ``seq_axis``: inputs ``(..., T, d)``.
DEFAULT_SEQ_AXIS = -2


class SequenceLayout(NamedTuple):
    """The time axis ``axis`` (non-negative) of inputs with ``ndim`` dimensions."""

    axis: int
    ndim: int

    @classmethod
    def of(cls, seq_axis: Any, q: Any, *, name: str = "q") -> SequenceLayout:
        """Validate ``seq_axis`` against ``q`` (the first sequence argument, called ``name``)."""
        check_static("seq_axis", seq_axis)
        if isinstance(seq_axis, bool) or not isinstance(seq_axis, numbers.Integral):
            raise TypeError(f"seq_axis must be an int, got {type(seq_axis).__name__}")
        ndim = getattr(q, "ndim", None)
        if not isinstance(ndim, int) or ndim < 2:
            # Not a sequence at all: the input checks name the problem; keep the default here.
            return cls(0, 2)
        axis = int(seq_axis)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"seq_axis={axis} is out of range for {name} with {ndim} dimensions "
                f"(shape {tuple(q.shape)})"
            )
        axis %= ndim
        if axis == ndim - 1:
            raise ValueError(
                f"seq_axis={seq_axis} is the feature axis of {name} (shape {tuple(q.shape)}); "
                "the feature axis is always the last one"
            )
        return cls(axis, ndim)

    @property
    def is_standard(self) -> bool:
        """Whether the time axis is already second to last."""
        return self.axis == self.ndim - 2

    def _order(self) -> tuple[int, ...]:
        rest = [i for i in range(self.ndim - 1) if i != self.axis]
        return (*rest, self.axis, self.ndim - 1)

    def to_standard(self, **arrays: Any) -> tuple[Any, ...]:
        """The named arrays with the time axis moved to -2 (unchanged in the standard layout)."""
        if self.is_standard:
            return tuple(arrays.values())
        xp = namespace_of(**arrays)
        moved = []
        for name, x in arrays.items():
            if x.ndim != self.ndim:
                raise ValueError(
                    f"{name} has {x.ndim} dimensions but q has {self.ndim}; with seq_axis all "
                    "sequence arguments must have the same number of dimensions"
                )
            moved.append(xp.permute_dims(x, self._order()))
        return tuple(moved)

    def per_token_to_standard(self, name: str, x: Any) -> Any:
        """A per-token argument (``log_decay``, ``beta``) in the caller's layout, moved like
        the inputs.

        ``None``, numbers (NumPy scalars too), 0-d arrays and anything that is not an array
        (the argument's own check names it) are returned as given: a number or a 0-d array
        broadcasts in any layout. Any other array must have the full rank of ``q``.
        """
        if self.is_standard or x is None or is_real_number(x) or not is_array(x) or x.ndim == 0:
            return x
        return self.to_standard(**{name: x})[0]

    def caller_shape(self, shape: tuple) -> tuple:
        """A shape in the standard layout as the caller sees it (the time axis back in place);
        a shape of another rank than the inputs' is returned as given."""
        if self.is_standard or len(shape) != self.ndim:
            return tuple(shape)
        caller = [None] * self.ndim
        for standard, original in enumerate(self._order()):
            caller[original] = shape[standard]
        return tuple(caller)

    def restore(self, x: Any) -> Any:
        """An output ``(..., T, d)`` in the standard layout, back in the callers' layout."""
        if self.is_standard:
            return x
        order = self._order()
        inverse = tuple(order.index(i) for i in range(self.ndim))
        return namespace_of(output=x).permute_dims(x, inverse)


def standard_layout(seq_axis: Any, **arrays: Any) -> tuple[Any, ...]:
    """Validate ``seq_axis`` and move the time axis of the named arrays to -2.

    Returns ``(layout, *arrays)``; ``seq_axis`` is checked against the first array.
    """
    name, first = next(iter(arrays.items()))
    layout = SequenceLayout.of(seq_axis, first, name=name)
    return (layout, *layout.to_standard(**arrays))
