"""Everything between the caller and the math: validation, layouts, masks, varlen, gates,
states, the prepared-step skeleton. Imports :mod:`polylin._backend` and
:mod:`polylin.feature_maps` only.
"""
