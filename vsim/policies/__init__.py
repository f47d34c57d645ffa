"""Memory policies. Adding one is one file here and one import line below."""

from .base import Plan, Policy, parse_spec, register, registry
from . import none  # noqa: F401  (registers)

__all__ = ["Plan", "Policy", "parse_spec", "register", "registry", "make_policy"]


def make_policy(spec: str) -> Policy:
    """Build a policy from 'NAME:key=value,...'; PolicyError lists valid names and keys."""
    policy: Policy = parse_spec(spec, registry(), "policy")
    return policy
