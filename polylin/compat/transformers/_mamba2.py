"""The Mamba-2 (SSD) mixers: Mamba2, Bamba, GraniteMoeHybrid, FalconH1, NemotronH, Zamba2."""

from __future__ import annotations

from ._registry import Conversion

CONVERSIONS: dict[str, Conversion] = {}
