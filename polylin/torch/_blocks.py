"""What the PyTorch layers share: the cache type, the short convolution, the gated RMSNorm,
the input checks and the gate parameters' initialization. Every number comes from polylin's
functions (a block's from :mod:`polylin.blocks`); these modules hold parameters."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import LinearAttentionState
from ..convolution import causal_conv1d, causal_conv1d_step
from ..normalization import rms_norm

__all__ = [
    "Block",
    "LayerCache",
    "RMSNorm",
    "ShortConvolution",
    "check_cache",
    "check_dtype",
    "check_hidden",
    "inverse_softplus_dt",
    "padding_mask",
    "positive_int",
]


#: How to turn another convention's mask into polylin's, in the words of the functions' own mask
#: errors (the layers check values, which the functions, reading dtypes only, cannot).
_MASK_CONVERSION = (
    "polylin's masks are boolean, True = real token (a mask selects, it is never added); "
    "convert a 0/1 mask with {name}=(mask != 0) and an additive mask (0 for real tokens, "
    "-inf for padding) with {name}=(mask == 0)"
)


def _check_flag(name: str, value: Any) -> None:
    """A boolean option must be a Python bool (an array or ``None`` is truthy by accident)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def _tensor(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as a plain tensor view: ``torch.compile`` traces polylin's input checks of a
    tensor, not of an ``nn.Parameter`` (its type's module name is not a constant there)."""
    return None if parameter is None else parameter[...]


class _LayerCacheFields(NamedTuple):
    conv_state: tuple[torch.Tensor, ...]
    recurrent_state: Any


class LayerCache(_LayerCacheFields):
    """What a layer needs to continue a sequence: its convolution states and recurrent state.

    Returned by ``forward(..., return_cache=True)`` and by ``step``, taken back by both. Its
    size does not grow with the sequence.

    Parameters
    ----------
    conv_state : tuple of torch.Tensor
        One state per short convolution, in the order the layer documents, each the last
        ``conv_size - 1`` inputs of that convolution: ``(batch, conv_size - 1, channels)``.
        Empty without short convolutions.
    recurrent_state : torch.Tensor or polylin.LinearAttentionState
        The state of the recurrence: a :class:`polylin.LinearAttentionState` for the layers on
        :func:`polylin.causal_linear_attention` (GLA, Mamba-2), the matrix ``S`` of shape
        ``(batch, heads, d_k, d_v)`` for the delta-rule layers.
    made_by : str, optional
        Keyword only: the layer class and the sizes that shape its cache, as the layers record
        them (``"GatedDeltaNet(num_heads=2, ...)"``). A layer given a cache made by another
        kind of layer, or by one of other sizes, raises a ``ValueError`` naming both; ``None``
        (a cache built by hand) is checked by its shapes only. It is not one of the tuple's
        fields: a cache still unpacks, compares and prints as ``(conv_state,
        recurrent_state)``.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import GatedDeltaNet
    >>> layer = GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=8)
    >>> _, cache = layer(torch.randn(1, 5, 32), return_cache=True)
    >>> [tuple(s.shape) for s in cache.conv_state], tuple(cache.recurrent_state.shape)
    ([(1, 3, 16), (1, 3, 16), (1, 3, 32)], (1, 2, 8, 16))
    >>> cache.made_by.startswith("GatedDeltaNet(num_heads=2, num_v_heads=2, head_dim=8,")
    True
    """

    #: The layer that made the cache (see the class docstring); ``None`` for one built by
    #: hand, and for ``_make`` and ``_replace``, which bypass ``__new__``.
    made_by: str | None = None

    def __new__(
        cls,
        conv_state: tuple[torch.Tensor, ...],
        recurrent_state: Any,
        *,
        made_by: str | None = None,
    ) -> LayerCache:
        cache = super().__new__(cls, conv_state, recurrent_state)
        if made_by is not None:
            cache.made_by = made_by
        return cache


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution over time with its decoding state (the blocks' short conv).

    An :class:`torch.nn.Conv1d` with ``groups=channels`` (its ``weight`` is
    ``(channels, 1, kernel_size)``, as in flash-linear-attention's ``ShortConvolution`` and
    Mamba-2's ``conv1d``) whose forward pass is :func:`polylin.causal_conv1d` on
    ``(batch, T, channels)`` inputs.

    Parameters
    ----------
    hidden_size : int
        Number of channels.
    kernel_size : int
        Width of the convolution.
    bias : bool
        Whether it has a bias.
    activation : {"silu", None}
        Applied after the convolution.
    device, dtype : optional
        As for :class:`torch.nn.Conv1d`.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import ShortConvolution
    >>> conv = ShortConvolution(6, 4)
    >>> y, state = conv(torch.randn(2, 9, 6), return_state=True)
    >>> y.shape, state.shape
    (torch.Size([2, 9, 6]), torch.Size([2, 3, 6]))
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        *,
        bias: bool = False,
        activation: str | None = "silu",
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            hidden_size,
            hidden_size,
            kernel_size,
            groups=hidden_size,
            padding=kernel_size - 1,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.hidden_size, self.activation = hidden_size, activation

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        return_state: bool = False,
    ) -> Any:
        """:func:`polylin.causal_conv1d` of ``x`` ``(batch, T, channels)``."""
        return causal_conv1d(
            x,
            self.weight[:, 0],
            _tensor(self.bias),
            activation=self.activation,
            state=state,
            return_state=return_state,
            attention_mask=attention_mask,
        )

    def step(
        self,
        x_t: torch.Tensor,
        state: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`polylin.causal_conv1d_step` of ``x_t`` ``(batch, channels)``."""
        return causal_conv1d_step(
            x_t,
            self.weight[:, 0],
            _tensor(self.bias),
            state=state,
            activation=self.activation,
            attention_mask=attention_mask,
        )


class RMSNorm(nn.Module):
    """RMSNorm over the last axis, optionally gated: :func:`polylin.rms_norm` with a weight.

    Parameters
    ----------
    hidden_size : int
        Size of the normalized axis (of each group with ``group_size``).
    eps : float
        Added to the mean square.
    activation : {"silu", "sigmoid"}
        The gate's activation.
    norm_before_gate : bool
        ``True``: ``norm(x) * weight * act(gate)`` (flash-linear-attention's
        ``FusedRMSNormGated``); ``False``: ``norm(x * act(gate)) * weight`` (Mamba-2).
    group_size : int, optional
        Normalize groups of this many channels separately (Mamba-2's ``n_groups``).
    elementwise_affine : bool
        Whether it has a ``weight`` (ones at first).
    device, dtype : optional
        Where and in which dtype to create the weight.

    Examples
    --------
    >>> import torch
    >>> from polylin.torch import RMSNorm
    >>> norm = RMSNorm(4)
    >>> norm(torch.tensor([[3.0, -4.0, 3.0, -4.0]])).detach().round(decimals=4)
    tensor([[ 0.8485, -1.1314,  0.8485, -1.1314]])
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        activation: str = "silu",
        norm_before_gate: bool = True,
        group_size: int | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        _check_flag("norm_before_gate", norm_before_gate)
        _check_flag("elementwise_affine", elementwise_affine)
        self.hidden_size, self.eps, self.activation = hidden_size, eps, activation
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of {group_size=}")
        weight = torch.ones(hidden_size, device=device, dtype=dtype)
        self.weight = nn.Parameter(weight) if elementwise_affine else None

    def extra_repr(self) -> str:
        """The options, shown by ``print(norm)``."""
        return (
            f"{self.hidden_size}, eps={self.eps}, activation={self.activation!r}, "
            f"norm_before_gate={self.norm_before_gate}, group_size={self.group_size}"
        )

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize ``x`` ``(..., hidden_size)``, gated by ``gate`` of the same shape."""
        weight = _tensor(self.weight)
        if self.group_size is not None and self.group_size != self.hidden_size:
            groups = (self.hidden_size // self.group_size, self.group_size)
            shape = x.shape
            x = x.reshape(*shape[:-1], *groups)
            gate = None if gate is None else gate.reshape(*shape[:-1], *groups)
            weight = None if weight is None else weight.reshape(groups)
            out = rms_norm(
                x, weight, gate=gate, eps=self.eps, activation=self.activation,
                norm_before_gate=self.norm_before_gate,
            )  # fmt: skip
            return out.reshape(shape)
        return rms_norm(
            x, weight, gate=gate, eps=self.eps, activation=self.activation,
            norm_before_gate=self.norm_before_gate,
        )  # fmt: skip


def check_hidden(x: Any, name: str, rank: int, hidden_size: int) -> None:
    """``x`` is a tensor ``(batch, T, hidden_size)`` (rank 3) or ``(batch, hidden_size)``."""
    layout = "(batch, T, hidden_size)" if rank == 3 else "(batch, hidden_size)"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != rank or x.shape[-1] != hidden_size:
        raise ValueError(
            f"{name} must have shape {layout} with hidden_size={hidden_size}, got {tuple(x.shape)}"
        )


def padding_mask(attention_mask: Any, shape: tuple[int, ...]) -> torch.Tensor | None:
    """A tokenizer's mask (bool or 0/1) of ``shape`` (``(batch, T)``, or ``(batch,)`` for one
    token) as a bool tensor; ``None`` stays.

    A boolean mask is used as given. Any other real mask must hold 0 and 1 only (1 for real
    tokens), integer or float: other values (an additive mask, 0 for real tokens and -inf for
    padding, which ``!= 0`` would invert) are a ``ValueError`` saying how to convert it. The
    check reads the mask (one wait for the device on CUDA: pass a boolean mask to skip it).
    Under ``torch.compile`` an integer mask's values are not checked (reading them would break
    the graph; a tokenizer's mask is 0/1 by construction), a float mask's are, outside the
    graph.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}"
        )
    if tuple(attention_mask.shape) != shape:
        layout = "(batch, T)" if len(shape) == 2 else "(batch,)"
        raise ValueError(
            f"attention_mask must have shape {layout} = {shape}, got {tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_complex():
        raise TypeError(
            f"attention_mask must be boolean or 0/1, got {attention_mask.dtype}: "
            f"{_MASK_CONVERSION.format(name='attention_mask')}"
        )
    if not torch.compiler.is_compiling():
        _check_zero_one(attention_mask)
    elif attention_mask.is_floating_point():
        _check_zero_one_outside_graph(attention_mask)
    return attention_mask != 0


def _check_zero_one(attention_mask: torch.Tensor) -> None:
    """A non-boolean mask holds 0 and 1 only (see :func:`padding_mask`)."""
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError(
            f"attention_mask must be boolean or hold 0 and 1 only (1 for real tokens), got a "
            f"{attention_mask.dtype} mask with other values: "
            f"{_MASK_CONVERSION.format(name='attention_mask')}"
        )


_check_zero_one_outside_graph = torch.compiler.disable(_check_zero_one)


def inverse_softplus_dt(
    size: int,
    *,
    dt_min: float = 0.001,
    dt_max: float = 0.1,
    dt_init_floor: float = 1e-4,
    device: Any = None,
) -> torch.Tensor:
    """``dt_bias`` at initialization: ``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]``.

    Mamba's initialization (also Gated DeltaNet's and KDA's): ``dt`` log-uniform, floored at
    ``dt_init_floor``, and ``dt_bias = dt + log(-expm1(-dt))``, the inverse of softplus.
    """
    log_dt = torch.rand(size, device=device) * (math.log(dt_max) - math.log(dt_min))
    dt = torch.clamp(torch.exp(log_dt + math.log(dt_min)), min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


def _another_layers_cache(origin: str, layer: str) -> ValueError:
    """The error for a cache from another layer: where it comes from (``origin``), which
    layer this is, what to pass instead."""
    return ValueError(
        f"cache is another layer's cache: {origin}, and this layer is {layer}; pass the cache "
        "that this layer's forward(..., return_cache=True) or step returned"
    )


def check_cache(
    cache: Any,
    convs: list[ShortConvolution],
    batch: int,
    state_kind: type,
    *,
    layer: str = "this layer",
) -> None:
    """A cache given back to a layer is a :class:`LayerCache` with one state per convolution
    of ``convs`` (each ``(batch, width - 1, channels)``) and a recurrent state of
    ``state_kind`` (a tensor, or a :class:`~polylin.LinearAttentionState`) for ``batch``
    sequences, made by ``layer`` (the layer's :attr:`LayerCache.made_by`) when it says who
    made it; the recurrent state's shape past the batch is checked where it is used."""
    if cache is None:
        return
    if isinstance(cache, LinearAttentionState):
        origin = (
            "a polylin.LinearAttentionState, the state of a polylin.torch.LinearAttention "
            "layer (or of polylin's functions)"
        )
        raise _another_layers_cache(origin, layer)
    if not isinstance(cache, LayerCache):
        raise TypeError(f"cache must be a polylin.torch.LayerCache, got {type(cache).__name__}")
    if cache.made_by is not None and cache.made_by != layer:
        raise _another_layers_cache(f"it was made by {cache.made_by}", layer)
    conv_state = cache.conv_state
    if not isinstance(conv_state, tuple) or len(conv_state) != len(convs):
        tuple_ = isinstance(conv_state, tuple)
        got: object = len(conv_state) if tuple_ else type(conv_state).__name__
        raise ValueError(
            f"cache.conv_state must be a tuple of {len(convs)} convolution states for this "
            f"layer, got {got} (is it another layer's cache?)"
        )
    for i, (state, conv) in enumerate(zip(conv_state, convs)):
        if not isinstance(state, torch.Tensor) or state.ndim != 3 or state.shape[0] != batch:
            shape = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(
                f"cache.conv_state[{i}] must be a tensor (batch, width - 1, channels) for "
                f"batch={batch}, got {shape}"
            )
        want = (batch, conv.kernel_size[0] - 1, conv.hidden_size)
        if tuple(state.shape) != want:
            raise ValueError(
                f"cache.conv_state[{i}] must have shape (batch, width - 1, channels) = {want} "
                f"for {layer}, got {tuple(state.shape)} (is it another layer's cache?)"
            )
    state = cache.recurrent_state
    kind = "a torch.Tensor" if state_kind is torch.Tensor else "a polylin.LinearAttentionState"
    if not isinstance(state, state_kind):
        raise TypeError(
            f"cache.recurrent_state must be {kind} for this layer, got {type(state).__name__} "
            "(is it another layer's cache?)"
        )
    first = state if state_kind is torch.Tensor else state[0]
    if not isinstance(first, torch.Tensor) or first.ndim < 1 or first.shape[0] != batch:
        shape = tuple(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise ValueError(
            f"cache.recurrent_state is for another batch: batch={batch} here, got shape {shape}"
        )


def check_dtype(x: torch.Tensor, name: str, module: nn.Module) -> None:
    """``x`` has the dtype of the layer's input projection (a mixed-dtype matmul would fail
    deep inside, naming neither; parameters kept in float32 on purpose do not count)."""
    linear = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    weight = None if linear is None else linear.weight
    if weight is not None and x.dtype != weight.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the layer's weights have dtype {weight.dtype}; "
            f"convert the input ({name}.to({weight.dtype})) or the layer (layer.to({x.dtype}))"
        )


def positive_int(name: str, value: Any) -> int:
    """``value`` as a positive int, or a ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class Block(nn.Module):
    """What every block does around its own computation: input checks, padding, zero outputs.

    A subclass sets ``hidden_size`` and defines :meth:`_sequence` (a whole sequence) and
    :meth:`_token` (one token per sequence), which receive inputs whose masked rows are
    already zeros and return the output and the new :class:`LayerCache`; masked outputs are
    zeroed here.
    """

    hidden_size: int
    #: The type of the cache's recurrent state: one tensor, or a LinearAttentionState.
    _state_kind: type = torch.Tensor

    def _params(self) -> dict[str, torch.Tensor]:
        """The parameters by their state-dict names, as :mod:`polylin.blocks` takes them;
        under ``torch.compile`` as plain tensor views (it traces polylin's checks of a tensor,
        not of an ``nn.Parameter``; eagerly the views would cost 50 us a call)."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        if torch.compiler.is_compiling():
            return {name: p[...] for name, p in params.items()}
        return params

    def _convs(self) -> list[ShortConvolution]:
        """The block's short convolutions, in the order of the cache's ``conv_state``."""
        return []

    def _cache_sizes(self) -> dict[str, Any]:
        """The options that shape the block's cache, by name (for :meth:`_made_by`)."""
        return {}

    def _made_by(self) -> str:
        """The block as its caches record it (:attr:`LayerCache.made_by`): its class and the
        sizes that shape its cache."""
        sizes = ", ".join(f"{name}={value!r}" for name, value in self._cache_sizes().items())
        return f"{type(self).__name__}({sizes})"

    def _sequence(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        """The output and the new cache's ``(conv_state, recurrent_state)``."""
        raise NotImplementedError

    def _token(
        self, x_t: torch.Tensor, mask: torch.Tensor | None, cache: LayerCache | None
    ) -> tuple[torch.Tensor, tuple[Any, Any]]:
        """The output and the new cache's ``(conv_state, recurrent_state)``."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        return_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LayerCache]:
        """The block over a whole sequence (training, prefill).

        Parameters
        ----------
        x : torch.Tensor
            ``(batch, T, hidden_size)``.
        attention_mask : torch.Tensor, optional
            ``(batch, T)``, True (or 1) for real tokens: left or right padding. Padded tokens
            are selected away before the projections: whatever they hold, they reach no real
            output, no convolution state and no recurrent state, and their outputs are 0.
            Other values (an additive 0/-inf mask) are an error: pass ``mask == 0`` for those.
        cache : LayerCache, optional
            The cache after earlier tokens, to continue from.
        return_cache : bool
            Also return the cache after the last token.

        Returns
        -------
        torch.Tensor or (torch.Tensor, LayerCache)
            ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> x = torch.randn(2, 6, 16)
        >>> mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded
        >>> y, cache = layer(x, mask, return_cache=True)
        >>> y.shape, bool((y[0, :2] == 0).all())
        (torch.Size([2, 6, 16]), True)
        """
        check_hidden(x, "x", 3, self.hidden_size)
        _check_flag("return_cache", return_cache)
        check_dtype(x, "x", self)
        made_by = self._made_by()
        check_cache(cache, self._convs(), x.shape[0], self._state_kind, layer=made_by)
        mask = padding_mask(attention_mask, tuple(x.shape[:2]))
        if mask is not None:
            x = torch.where(mask[..., None], x, 0.0)
        out, new_cache = self._sequence(x, mask, cache)
        if mask is not None:
            out = torch.where(mask[..., None], out, 0.0)
        if not return_cache:
            return out
        return out, LayerCache(*new_cache, made_by=made_by)

    def step(
        self,
        x_t: torch.Tensor,
        cache: LayerCache | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """One new token per sequence, from the cache of the tokens before it.

        Parameters
        ----------
        x_t : torch.Tensor
            ``(batch, hidden_size)``.
        cache : LayerCache, optional
            From ``forward(..., return_cache=True)`` or an earlier ``step``; ``None`` starts
            from an empty sequence.
        attention_mask : torch.Tensor, optional
            ``(batch,)``: the rows that take this token. The others (finished sequences) keep
            their cache and output 0, whatever ``x_t`` holds there.

        Returns
        -------
        y_t : torch.Tensor
            ``(batch, hidden_size)``.
        cache : LayerCache
            The cache after this token.

        Examples
        --------
        >>> import torch
        >>> from polylin.torch import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> y_t, cache = layer.step(torch.randn(3, 16))   # the first token of 3 sequences
        >>> y_t, cache = layer.step(torch.randn(3, 16), cache)
        >>> y_t.shape
        torch.Size([3, 16])
        """
        check_hidden(x_t, "x_t", 2, self.hidden_size)
        check_dtype(x_t, "x_t", self)
        made_by = self._made_by()
        check_cache(cache, self._convs(), x_t.shape[0], self._state_kind, layer=made_by)
        mask = padding_mask(attention_mask, (x_t.shape[0],))
        if mask is not None:
            x_t = torch.where(mask[:, None], x_t, 0.0)
        out, new_cache = self._token(x_t, mask, cache)
        if mask is not None:
            out = torch.where(mask[:, None], out, 0.0)
        return out, LayerCache(*new_cache, made_by=made_by)
