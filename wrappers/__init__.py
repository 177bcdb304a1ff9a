"""Adapters built on top of chatenv: policy wrappers, reference-model and KL env wrappers.

This package imports :mod:`chatenv`; :mod:`chatenv` never imports it.
"""

__all__: list[str] = []
