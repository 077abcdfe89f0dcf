"""What kind of fault an exception is, decided where its type is known (never from its text)."""

from __future__ import annotations

from bastion.ipc.messages import FailureKind
from bastion.procs.distributed import DistributedTimeout


class InjectedFault(RuntimeError):
    """A drill's fault (``--enable-fault-injection``)."""


class WorkerFailure(RuntimeError):
    """A worker died, failed a step or stopped answering."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.EXCEPTION) -> None:
        super().__init__(message)
        self.kind = kind


def failure_kind(exc: BaseException) -> FailureKind:
    if isinstance(exc, WorkerFailure):
        return exc.kind
    if isinstance(exc, InjectedFault):
        return FailureKind.INJECTED
    if isinstance(exc, DistributedTimeout):
        return FailureKind.COLLECTIVE
    return FailureKind.EXCEPTION
