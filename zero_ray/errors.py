"""Domain exceptions. Every error names the offending value and, where there is one, the fix."""

from __future__ import annotations


class ZeroRayError(Exception):
    """Base class of every error zero_ray raises on purpose."""


class ConfigError(ZeroRayError, ValueError):
    """A configuration value is out of range or inconsistent with another."""


class ResourceError(ZeroRayError):
    """The cluster cannot host what the configuration asks for."""


class ModelError(ZeroRayError):
    """The user's model or loss function cannot be trained as given."""


class OwnerError(ZeroRayError):
    """A partition owner failed; carries the rank and the remote traceback."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = message if not remote_traceback else f"{message}\n\nRemote traceback:\n{remote_traceback}"
        super().__init__(text)


def domain_error(cls: object, message: str, *, rank: int | None, fallback: str | None = None,
                 remote_traceback: str = "") -> ZeroRayError:
    """Re-raise a remote failure as its own domain type: ``cls(message)`` when ``cls`` is a
    ZeroRayError subclass built from a message alone; otherwise an OwnerError naming the rank,
    with ``fallback`` (default ``message``) as its text."""
    if isinstance(cls, type) and issubclass(cls, ZeroRayError) and not issubclass(cls, OwnerError):
        try:
            return cls(message)
        except TypeError:  # a subclass with a richer constructor: fall back to OwnerError
            pass
    return OwnerError(message if fallback is None else fallback, rank=rank, remote_traceback=remote_traceback)


class OwnerLostError(OwnerError):
    """A partition owner died or stopped answering."""


class CollectiveError(ZeroRayError):
    """A collective operation failed (a peer died, the group was aborted)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective operation did not complete within its timeout."""


class CheckpointError(ZeroRayError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class ControlError(ZeroRayError):
    """A control-plane (gRPC) call failed."""


class AuthError(ControlError):
    """A control-plane call was refused for its credentials."""


class ResizeInterrupted(ZeroRayError):
    """A resize failed part-way; the run was restored (at the size it could) and continues."""


class StopRequested(ZeroRayError):
    """An operator asked the run to stop (``zero-ray stop``); no further steps are taken."""
