"""Memory policies. Adding one is one file here and one import line below."""

from . import (  # noqa: F401  (each registers its policies)
    accudnn,
    hybrid,
    layrub,
    none,
    recompute,
    saved,
    superneurons,
    vdnn,
    vdnnpp,
)
from .base import Plan, Policy, parse_spec, register, registry

__all__ = ["Plan", "Policy", "parse_spec", "register", "registry", "make_policy"]


def make_policy(spec: str) -> Policy:
    """Build a policy from 'NAME:key=value,...'; PolicyError lists valid names and keys."""
    policy: Policy = parse_spec(spec, registry(), "policy")
    return policy
