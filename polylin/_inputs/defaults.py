"""The library's defaults, public as :data:`polylin.DEFAULT_CHUNK_SIZE` and
:data:`polylin.DEFAULT_EPS`."""

from __future__ import annotations

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_EPS"]


#: Default added to the normalizer of every normalized entry point.
DEFAULT_EPS = 1e-6


#: Default chunk length of the chunked forms.
DEFAULT_CHUNK_SIZE = 64
