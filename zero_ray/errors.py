"""Domain exceptions. Every error names the offending value and, where there is one, the fix."""

from __future__ import annotations

from collections.abc import Sequence


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


class NonFiniteError(ZeroRayError):
    """A step's loss or gradients were non-finite and ``ZeroConfig(on_nonfinite="raise")``:
    the step was not taken on any rank (no update, no scheduler step, no state changed, the
    position not advanced) and the trainer stays usable; the next ``step()`` is step ``step``
    again. ``loss_ranks``: the ranks whose own loss was non-finite (their piece of the batch);
    ``grad_ranks``: the ranks whose slice of the reduced gradient was (every rank when the
    gradient is replicated, as at stage 0)."""

    def __init__(self, message: str, *, step: int | None = None, loss_ranks: tuple[int, ...] = (),
                 grad_ranks: tuple[int, ...] = ()) -> None:
        self.step = step
        self.loss_ranks = tuple(loss_ranks)
        self.grad_ranks = tuple(grad_ranks)
        super().__init__(message)

    @staticmethod
    def describe(step: int, loss_ranks: Sequence[int], grad_ranks: Sequence[int]) -> str:
        """What was non-finite in step number ``step`` (1-based, as ``metrics["step"]``)."""
        parts = []
        if loss_ranks:
            parts.append(f"the loss on rank{'s' if len(loss_ranks) > 1 else ''} {', '.join(map(str, loss_ranks))}")
        if grad_ranks:
            parts.append(f"the reduced gradient in the slice{'s' if len(grad_ranks) > 1 else ''} of rank"
                         f"{'s' if len(grad_ranks) > 1 else ''} {', '.join(map(str, grad_ranks))}")
        return f"step {step}: non-finite values in {' and '.join(parts) or 'the gradient norm'}"

    @classmethod
    def refused(cls, step: int, loss_ranks: Sequence[int], grad_ranks: Sequence[int]) -> NonFiniteError:
        """The error of step number ``step`` refused under ``on_nonfinite="raise"``."""
        return cls(f"{cls.describe(step, loss_ranks, grad_ranks)}. The step was not taken: every rank is as "
                   f"before it (parameters, optimizer and scheduler state, buffers, RNG) and step_count stays at "
                   f"{step - 1}. Drop or fix that batch and call step() again, or pass "
                   "ZeroConfig(on_nonfinite=\"skip\") to skip such steps and go on",
                   step=step, loss_ranks=tuple(loss_ranks), grad_ranks=tuple(grad_ranks))


class StopRequested(ZeroRayError):
    """An operator asked the run to stop (``zero-ray stop``); no further steps are taken."""
