"""Errors raised on bad input. The command line turns each into one line and exit code 2.

Every error names where the problem is (a file and a place inside it) so that a user can fix it
without reading a traceback.
"""

from __future__ import annotations


class VsimError(Exception):
    """Base of every error caused by input the user gave (files, names, options)."""

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class UnitError(VsimError):
    """A quantity without a unit, with an unknown unit, or out of range."""


class TraceError(VsimError):
    """A trace file that cannot be read, is of an unsupported version, or is inconsistent."""


class HardwareError(VsimError):
    """A hardware profile that cannot be found or is invalid."""


class ConfigError(VsimError):
    """A bad option, specification string or configuration file."""


class PolicyError(VsimError):
    """A policy that does not exist or was given bad parameters."""


class WorkerError(VsimError):
    """A worker process of a sweep died (killed, out of memory): not bad input, but a one-line
    error with what was kept and how to resume, rather than a traceback."""
