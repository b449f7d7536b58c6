"""The one Flax NNX wrapper every block shares: parameters by their state-dict names, the
computation of :mod:`polylin.blocks`.

A block module holds its parameters as ``nnx.Param``s in an ``nnx.Dict`` keyed by the torch
module's state-dict names (``"q_proj.weight"``; Flax attribute names cannot hold dots, dict keys
can) and its constructor keywords; ``__call__`` and ``step`` hand both to the block's functions,
which compute every number. A subclass names its functions and spells out its keywords.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from ..blocks import BlockCache

__all__ = ["Block"]


class _Reading(Mapping[str, Any]):
    """A mapping that notes which of its names the block reads (for the load's name check)."""

    def __init__(self, arrays: Mapping[str, Any], read: set[str]) -> None:
        self._arrays, self._read = arrays, read

    def __getitem__(self, name: str) -> Any:
        value = self._arrays[name]
        self._read.add(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def _as_jax(name: str, value: Any, dtype: Any, device: Any) -> jax.Array:
    """A parameter of any library (a torch tensor, a NumPy or JAX array) as a JAX array."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor, without torch
        value = value.detach().cpu().numpy()
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"state_dict[{name!r}] must be an array, got {type(value).__name__}")
    array = jnp.asarray(value, dtype=dtype)
    return array if device is None else jax.device_put(array, device)


def _seed(seed: int, rngs: nnx.Rngs | None) -> int:
    """The seed of the draws: ``seed``, or one drawn from ``rngs``'s ``params`` stream."""
    if rngs is None:
        return seed
    return int(jax.random.randint(rngs.params(), (), 0, 2**31 - 1))


class Block(nnx.Module):
    """A block of :mod:`polylin.blocks` as a Flax NNX module (the base of the layers).

    A subclass sets ``_block``, ``_block_step`` and ``_init`` (the block's functions) and
    passes its constructor keywords, by name, to ``Block.__init__``.
    """

    #: The block's functions: the whole sequence, one token, the initializer.
    _block: ClassVar[Callable[..., Any]]
    _block_step: ClassVar[Callable[..., Any]]
    _init: ClassVar[Callable[..., dict[str, Any]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Flax's metaclass makes ``inspect.signature(cls)`` that of its ``__call__`` (``*args,
        # **kwargs``): the layer's own keywords are its ``__init__``'s, for help() and the docs.
        init = inspect.signature(cls.__init__)
        signature = init.replace(parameters=list(init.parameters.values())[1:])
        cls.__signature__ = signature  # type: ignore[attr-defined]

    def __init__(
        self,
        options: dict[str, Any],
        *,
        params: Mapping[str, Any] | None,
        dtype: Any,
        device: Any,
        seed: int,
        rngs: nnx.Rngs | None,
    ) -> None:
        if params is None:
            accepted = inspect.signature(type(self)._init).parameters
            drawn = type(self)._init(
                jnp, **{k: v for k, v in options.items() if k in accepted},
                seed=_seed(seed, rngs), dtype=dtype, device=device,
            )  # fmt: skip
        else:
            if not isinstance(params, Mapping):
                raise TypeError(
                    f"params must be a mapping from state-dict names to arrays, got "
                    f"{type(params).__name__}"
                )
            drawn = {name: _as_jax(name, v, dtype, device) for name, v in params.items()}
        # Static (part of the graph definition): a hashable tuple, not a dict.
        self.options: tuple[tuple[str, Any], ...] = tuple(options.items())
        self.params = nnx.Dict({name: nnx.Param(value) for name, value in drawn.items()})
        self._check_params()

    @property
    def hidden_size(self) -> int:
        """Size of the input's last axis and of the output."""
        return int(dict(self.options)["hidden_size"])

    @property
    def dtype(self) -> Any:
        """The dtype of the parameters (of the first: the input projection's)."""
        return next(iter(self.params.values()))[...].dtype

    def _arrays(self) -> dict[str, Any]:
        """The parameters by their state-dict names, as the block functions take them."""
        return {name: p[...] for name, p in self.params.items()}

    def _check_params(self) -> None:
        """The keywords against the parameters' shapes, and every parameter a name the block
        reads: one token traced abstractly (``jax.eval_shape``), no computation."""
        read: set[str] = set()
        options = dict(self.options)

        def one_token(arrays: dict[str, Any], x_t: Any, inputs: dict[str, Any]) -> Any:
            return type(self)._block_step(_Reading(arrays, read), x_t, None, **inputs, **options)

        x_t = jax.ShapeDtypeStruct((1, self.hidden_size), self.dtype)
        jax.eval_shape(one_token, self._arrays(), x_t, self._step_inputs())
        unused = sorted(set(self.params) - read)
        if unused:
            raise ValueError(
                f"{type(self).__name__}: the parameters {unused} are not this block's (with "
                f"its options {options})"
            )

    def _step_inputs(self) -> dict[str, Any]:
        """The inputs besides ``x_t`` that one token of this block needs (abstract arrays for
        the load's check)."""
        return {}

    def _sequence(
        self, x: Any, attention_mask: Any, cache: Any, return_cache: bool, **inputs: Any
    ) -> Any:
        """The block function on the parameters, checked inputs and the options."""
        x = self._input(x, "x")
        mask = None if attention_mask is None else jnp.asarray(attention_mask)
        return type(self)._block(
            self._arrays(), x, attention_mask=mask, cache=cache, return_cache=return_cache,
            **inputs, **dict(self.options),
        )  # fmt: skip

    def _token(self, x_t: Any, cache: Any, attention_mask: Any, **inputs: Any) -> Any:
        """The step function on the parameters, checked inputs and the options."""
        x_t = self._input(x_t, "x_t")
        mask = None if attention_mask is None else jnp.asarray(attention_mask)
        return type(self)._block_step(
            self._arrays(), x_t, cache, attention_mask=mask, **inputs, **dict(self.options)
        )

    def _input(self, x: Any, name: str) -> Any:
        x = jnp.asarray(x)
        if x.dtype != self.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but the layer's parameters have dtype "
                f"{self.dtype}; convert the input ({name}.astype({self.dtype}))"
            )
        return x

    def __call__(
        self,
        x: Any,
        attention_mask: Any = None,
        cache: BlockCache | None = None,
        return_cache: bool = False,
    ) -> Any:
        """The block over a whole sequence (training, prefill).

        Parameters
        ----------
        x : jax.Array
            ``(batch, T, hidden_size)``, of the parameters' dtype.
        attention_mask : jax.Array, optional
            ``(batch, T)`` booleans, True for real tokens (left or right padding): padded
            tokens reach no real output, no convolution state and no recurrent state; their
            outputs are 0.
        cache : polylin.blocks.BlockCache, optional
            The cache after earlier tokens, to continue from.
        return_cache : bool
            Also return the cache after the last token.

        Returns
        -------
        jax.Array or (jax.Array, polylin.blocks.BlockCache)
            ``(batch, T, hidden_size)``, and the cache with ``return_cache``.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from polylin.flax import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> x = jnp.ones((2, 6, 16), jnp.float32)
        >>> mask = jnp.array([[False, False, True, True, True, True], [True] * 6])
        >>> y, cache = layer(x, mask, return_cache=True)
        >>> y.shape, bool((y[0, :2] == 0).all())
        ((2, 6, 16), True)
        """
        return self._sequence(x, attention_mask, cache, return_cache)

    def step(
        self, x_t: Any, cache: BlockCache | None = None, *, attention_mask: Any = None
    ) -> tuple[jax.Array, BlockCache]:
        """One new token per sequence, from the cache of the tokens before it.

        Parameters
        ----------
        x_t : jax.Array
            ``(batch, hidden_size)``.
        cache : polylin.blocks.BlockCache, optional
            From ``layer(..., return_cache=True)`` or an earlier ``step``; ``None`` starts
            from an empty sequence.
        attention_mask : jax.Array, optional
            ``(batch,)`` booleans: the rows that take this token. The others keep their cache
            and output 0, whatever ``x_t`` holds there.

        Returns
        -------
        y_t : jax.Array
            ``(batch, hidden_size)``.
        cache : polylin.blocks.BlockCache
            The cache after this token.

        Examples
        --------
        >>> import jax.numpy as jnp
        >>> from polylin.flax import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> y_t, cache = layer.step(jnp.ones((2, 16), jnp.float32))  # 2 sequences' 1st token
        >>> y_t, cache = layer.step(jnp.ones((2, 16), jnp.float32), cache)
        >>> y_t.shape
        (2, 16)
        """
        return self._token(x_t, cache, attention_mask)

    def state_dict(self) -> dict[str, jax.Array]:
        """The parameters by their state-dict names (the torch module's).

        Returns
        -------
        dict
            Name to ``jax.Array``; ``numpy.asarray`` of each gives the weights that
            :mod:`polylin.blocks` serves with NumPy, ``torch.from_numpy`` the torch module's.

        Examples
        --------
        >>> from polylin.flax import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> layer.state_dict()["q_proj.weight"].shape
        (8, 16)
        """
        return self._arrays()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the parameters by those of a state dict of the same names and shapes.

        Parameters
        ----------
        state_dict : mapping
            Name to array (a torch module's ``state_dict()``, NumPy or JAX arrays): exactly
            this layer's names, each of its shape. The values are converted to the layer's
            dtype.

        Raises
        ------
        KeyError
            Names missing or not this layer's.
        ValueError
            A parameter of another shape.

        Examples
        --------
        >>> import numpy as np
        >>> from polylin.blocks import init_gated_deltanet
        >>> from polylin.flax import GatedDeltaNet
        >>> layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=4)
        >>> weights = init_gated_deltanet(np, hidden_size=16, num_heads=2, head_dim=4, seed=1)
        >>> layer.load_state_dict(weights)
        >>> bool(np.array_equal(layer.state_dict()["A_log"], weights["A_log"]))
        True
        """
        missing = sorted(set(self.params) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self.params))
        if missing or unexpected:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing {missing}, unexpected {unexpected}"
            )
        new = {}
        for name, param in self.params.items():
            value = _as_jax(name, state_dict[name], param[...].dtype, None)
            if value.shape != param[...].shape:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: {name!r} has shape "
                    f"{tuple(value.shape)}, this layer's is {tuple(param[...].shape)}"
                )
            new[name] = value
        for name, value in new.items():
            self.params[name][...] = value

    @classmethod
    def from_torch_state_dict(cls, state_dict: Mapping[str, Any], /, **options: Any) -> Any:
        """The layer with these parameters: ``cls(**options, params=state_dict)``.

        Parameters
        ----------
        state_dict : mapping
            Name to array: a torch module's ``state_dict()`` (``polylin.torch``'s or
            ``fla.layers``'), NumPy or JAX arrays.
        **options
            The constructor keywords (the torch module's: its sizes must fit the shapes;
            ``dtype`` converts the parameters, by default kept in theirs).

        Returns
        -------
        Block
            The layer, computing what the torch module with that state dict computes.

        Examples
        --------
        >>> import numpy as np
        >>> from polylin.blocks import init_gated_deltanet
        >>> from polylin.flax import GatedDeltaNet
        >>> weights = init_gated_deltanet(np, hidden_size=16, num_heads=2, head_dim=4)
        >>> layer = GatedDeltaNet.from_torch_state_dict(
        ...     weights, hidden_size=16, num_heads=2, head_dim=4
        ... )
        >>> layer(np.ones((2, 6, 16), np.float32)).shape
        (2, 6, 16)
        """
        return cls(**options, params=state_dict)
