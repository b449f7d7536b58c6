"""The ground floor: namespace and device resolution, native fast ops, execution questions.

Imports nothing else of polylin (:mod:`polylin._typing` aside).
"""
