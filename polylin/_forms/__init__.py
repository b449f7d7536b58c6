"""The math: one folder per family, its chunked, recurrent and quadratic forms side by side.

``common`` holds the blocks the families share (the decayed intra-chunk products, the
triangular inverse). Imports :mod:`polylin._backend` only.
"""
