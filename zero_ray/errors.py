"""Domain exceptions. Every error names the offending value and, where there is one, the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ZeroRayError(Exception):
    """Base class of every error zero_ray raises on purpose."""

    # What failed on the far side of a control call, when this error was rebuilt from one.
    failure: FailureDetail | None = None


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


class CallTimeout(OwnerLostError):
    """A call on an owner did not finish within its deadline (``step_timeout_s`` for a step):
    alive or not, the run cannot wait on it. The recovery asks every owner's flight record
    where it is and treats the one the others wait for as lost."""


class CollectiveError(ZeroRayError):
    """A collective operation failed (a peer died, the group was aborted)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective operation did not complete within its timeout."""


class CheckpointError(ZeroRayError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class DataError(ZeroRayError):
    """Training data cannot be read or does not match what the run expects: a missing or
    unreadable file, a truncated token file, a schema mismatch, a read that kept failing. Fails
    the step that needed it (no owner is taken for lost); the message names the file."""


class ControlError(ZeroRayError):
    """A control-plane (gRPC) call failed. ``code`` is the gRPC status code's name
    (e.g. ``"UNAVAILABLE"``), empty when the call never got a status."""

    def __init__(self, message: str, *, code: str = "") -> None:
        self.code = code
        super().__init__(message)


class RemoteFailure(ControlError):
    """A control call reached its server and the handler raised: ``detail`` says what, as the
    status's FailureDetail carried it (``detail.error()`` is that domain error)."""

    def __init__(self, message: str, *, code: str, detail: FailureDetail) -> None:
        self.detail = detail
        super().__init__(message, code=code)


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


class RelayError(ZeroRayError):
    """The relay tree cannot do what was asked: a rank it does not hold was named lost, or no
    live rank is left for a relay to reach."""


class ReplyMismatchError(ZeroRayError):
    """Two ranks' replies disagree on a figure that is the same on every rank (a step's
    learning rate, gradient norm, skip, loss scale...): the ranks did not run the same step.
    Carries the field, both ranks and both values."""

    def __init__(self, message: str, *, field: str, ranks: tuple[int, int], values: tuple[object, object]) -> None:
        self.field = field
        self.ranks = ranks
        self.values = values
        super().__init__(message)


class StateCorruptError(ZeroRayError):
    """An owner's optimizer state on local disk (``Offload``) read back different from what was
    written: the owner's partition is not to be trusted, and it is treated as lost."""


class StopRequested(ZeroRayError):
    """An operator asked the run to stop (``zero-ray stop``); no further steps are taken."""


@dataclass(frozen=True, kw_only=True)
class FailureDetail:
    """Why a control call failed in its handler, field by field (``FailureDetail`` in
    protos/zero_ray/v1/common.proto): the exception's class name and message, the owner's rank
    and step phase, the exception it was raised from, the handler's traceback and the method."""

    type: str
    message: str
    rank: int | None = None
    phase: str = ""
    cause: str = ""
    remote_traceback: str = ""
    operation: str = ""

    def error(self, where: str, *, rank: int | None = None) -> ZeroRayError:
        """The domain error this describes, as raised on the owner: its own type when it is one
        of this module's (built from a message alone, or an OwnerError's kind with its rank),
        else an OwnerError; the text says ``where`` (e.g. "rank 1 on node 10.0.0.5 (pid 77)")
        failed in which operation and phase and ends with the remote traceback. ``rank``
        overrides the owner's (the caller's index). A relay names a child it could not reach
        OwnerLostError, or CallTimeout past the deadline (control/relay_hop.py): rebuilt as those,
        the recovery treats them as the driver's own fan-out's (a timeout's stall diagnosed, a
        re-formed step retried) rather than as an error the step raised."""
        rank = self.rank if rank is None else rank
        phase = f" ({self.phase})" if self.phase else ""
        head = f"{where} failed in {self.operation or 'a control call'}{phase}"
        cause = f"\ncaused by {self.cause}" if self.cause else ""
        cls = _domain_types().get(self.type)
        err: ZeroRayError | None = None
        if cls is not None and not issubclass(cls, OwnerError):
            trace = f"\n\nRemote traceback (rank {rank}):\n{self.remote_traceback}" if self.remote_traceback else ""
            try:
                err = cls(f"{head}: {self.message}{cause}{trace}")
            except TypeError:  # a subclass with a richer constructor: an OwnerError below
                err = None
        if err is None:
            # Other types (the user's RuntimeError) keep their name in the text.
            text = f"{head}: {self.message}" if cls is not None else f"{head}: {self.type}: {self.message}"
            kind = cls if cls is not None and issubclass(cls, OwnerError) else OwnerError
            err = kind(text + cause, rank=rank, remote_traceback=self.remote_traceback)
        err.failure = self
        return err


def _domain_types() -> dict[str, type[ZeroRayError]]:
    """This module's exception classes by name: the only types a FailureDetail is rebuilt as."""
    return {name: value for name, value in globals().items()
            if isinstance(value, type) and issubclass(value, ZeroRayError)}


class UnsupportedVersionError(ZeroRayError):
    """An installed dependency is not a version zero_ray's adapters over its private APIs
    (zero_ray/compat/) were written for, or lacks one of those APIs. Raised at import, naming
    the package, the installed version, the supported range and the fix."""

    def __init__(self, message: str, *, package: str = "", installed: str = "", supported: str = "") -> None:
        self.package, self.installed, self.supported = package, installed, supported
        super().__init__(message)
