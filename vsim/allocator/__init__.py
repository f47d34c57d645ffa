"""Allocator models. Adding one is one file here and one import line below."""

from . import caching, exact, expandable, pooled  # noqa: F401  (registers)
from .base import Allocator, AllocatorSpec, allocator_registry, make_allocator

__all__ = ["Allocator", "AllocatorSpec", "allocator_registry", "make_allocator"]
