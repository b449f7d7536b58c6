"""The gated short convolutions of LFM2 and its kin."""

from __future__ import annotations

from ._registry import Conversion

CONVERSIONS: dict[str, Conversion] = {}
