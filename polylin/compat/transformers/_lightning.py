"""MiniMax's lightning attention: linear attention with a fixed per-head decay."""

from __future__ import annotations

from ._registry import Conversion

CONVERSIONS: dict[str, Conversion] = {}
