"""The library's defaults, public as :data:`polylin.DEFAULT_CHUNK_SIZE`,
:data:`polylin.DEFAULT_DPLR_CHUNK_SIZE` and :data:`polylin.DEFAULT_EPS`."""

from __future__ import annotations

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_DPLR_CHUNK_SIZE", "DEFAULT_EPS"]


#: Default added to the normalizer of every normalized entry point.
DEFAULT_EPS = 1e-6


#: Default chunk length of the chunked forms.
DEFAULT_CHUNK_SIZE = 64


#: Default chunk length of the generalized (DPLR) rule's chunked form: its intra-chunk block
#: (four decayed matrices and a triangular solve) costs more per chunk than the others', and 32
#: measured 0.76-0.95x the time of 64 at RWKV-7's shapes with the same float32 accuracy.
DEFAULT_DPLR_CHUNK_SIZE = 32
