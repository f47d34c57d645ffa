"""Allocator models. Adding one is one file here and one import line below."""

from .base import Allocator, AllocatorSpec, allocator_registry, make_allocator
from . import exact  # noqa: F401  (registers)

__all__ = ["Allocator", "AllocatorSpec", "allocator_registry", "make_allocator"]
