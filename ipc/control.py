"""The control plane's wire types: launch settings, engine control, and the sentinels' peer
messages (DESIGN.md §3, §6).

NOTE: each family is a tagged union (``tag=`` an ``IntEnum`` value, the first element of the
array on the wire), decoded as a ``Union`` by ``ipc/codec.py``; nothing is parsed from text.
Orders carry an ``order_id`` (and the engine commands a ``seq``) so that a receiver can tell a
re-sent order from a new one and answer it again without acting twice.
"""

from __future__ import annotations

import enum

import msgspec

from bastion.ipc.messages import EngineStatus, FailureKind

_WIRE = {"array_like": True, "omit_defaults": True, "gc": False}


class Instruction(enum.IntEnum):
    """What a recovery does on each engine (``/fault_tolerance/apply``'s ``instruction``)."""

    PAUSE = 0  # manual mode: stop and wait for an operator
    RETRY = 1  # re-create the DP groups at a new epoch
    REINIT = 2  # also replace a dead, hung or failing engine process


class FaultInjection(enum.IntEnum):
    RAISE = 0  # an exception in the busy loop
    WORKER_EXIT = 1  # worker rank 0 exits
    HANG = 2  # the busy loop sticks inside a step


# ---------------------------------------------------------------------------------------------
# launch settings: the parent's HANDSHAKE tells a child what to run with
# ---------------------------------------------------------------------------------------------


class SentinelLaunch(msgspec.Struct, tag=0, **_WIRE):
    input: str  # the engine's input channel (the API binds it)
    output: str  # the API's output channel
    status: str  # the API's status channel (group status, fatal)
    cmd: str  # this sentinel's command channel from the API (apply, inject, shutdown)
    runtime_dir: str


class EngineLaunch(msgspec.Struct, tag=1, **_WIRE):
    input: str
    output: str
    control: str  # the sentinel's end of the control channel
    runtime_dir: str
    epoch: int = 0
    start_paused: bool = False  # a replacement: join the group at the next recover
    num_blocks: int | None = None  # the KV pool size the first start measured
    incarnation: int = 0  # counts this engine's starts; its control replies carry it


class WorkerLaunch(msgspec.Struct, tag=2, **_WIRE):
    execute: str
    worker_out: str
    runtime_dir: str
    dist_host: str
    dist_port: int
    dp_rank: int = 0
    dp_size: int = 1
    epoch: int = 0
    defer_groups: bool = False  # load the shard now, join the cross-engine groups at recover


Launch = SentinelLaunch | EngineLaunch | WorkerLaunch


class HandshakeInfo(msgspec.Struct, **_WIRE):
    """The parent's answer to HELLO: the config to run and the child's launch settings."""

    config_json: bytes
    launch: Launch | None = None
    rank: int = 0


# ---------------------------------------------------------------------------------------------
# sentinel -> engine (its control thread) and back
# ---------------------------------------------------------------------------------------------


class Command(enum.IntEnum):
    HEARTBEAT = 0
    PAUSE = 1
    RECOVER = 2
    INJECT = 3
    SHUTDOWN = 4


class Heartbeat(msgspec.Struct, tag=int(Command.HEARTBEAT), **_WIRE):
    seq: int


class PauseEngine(msgspec.Struct, tag=int(Command.PAUSE), **_WIRE):
    """Drop every request and the KV state; tear down the DP groups."""

    seq: int
    epoch: int = 0


class RecoverEngine(msgspec.Struct, tag=int(Command.RECOVER), **_WIRE):
    """Re-create the DP groups at ``epoch`` and run again."""

    seq: int
    epoch: int


class InjectFault(msgspec.Struct, tag=int(Command.INJECT), **_WIRE):
    seq: int
    kind: FaultInjection


class ShutdownEngine(msgspec.Struct, tag=int(Command.SHUTDOWN), **_WIRE):
    seq: int


EngineCommand = Heartbeat | PauseEngine | RecoverEngine | InjectFault | ShutdownEngine


class EngineReply(msgspec.Struct, tag=0, **_WIRE):
    """The engine's answer to a command (``seq``), with its health at that moment.

    ``seq == 0``: the control thread's first word, sent when it connects."""

    seq: int
    incarnation: int
    ok: bool = True
    error: str | None = None
    kind: FailureKind = FailureKind.NONE  # of the failure, when not ok
    num_steps: int = 0
    busy_for_s: float = 0.0  # how long the busy loop has been inside one step or collective
    epoch: int = 0
    is_running: bool = False


class EngineFault(msgspec.Struct, tag=1, **_WIRE):
    """Unsolicited: the busy loop caught a fault."""

    incarnation: int
    epoch: int
    kind: FailureKind
    info: str


EngineControlReply = EngineReply | EngineFault


# ---------------------------------------------------------------------------------------------
# between sentinels (the coordinator is sentinel 0, which also sends to itself), API <-> sentinel
# ---------------------------------------------------------------------------------------------


class PeerKind(enum.IntEnum):
    HELLO = 0
    FAULT = 1
    PAUSE = 2
    RECOVER = 3
    DONE = 4
    STATUS = 5
    FATAL = 6
    APPLY = 7
    INJECT = 8
    PROCESSES = 9


class PeerHello(msgspec.Struct, tag=int(PeerKind.HELLO), **_WIRE):
    """A sentinel whose engine is up; also sent again by a sentinel that restarted."""

    sender: int


class FaultReport(msgspec.Struct, tag=int(PeerKind.FAULT), **_WIRE):
    """A sentinel saw a fault in its engine, which ran at ``epoch``."""

    sender: int
    epoch: int
    kind: FailureKind
    info: str


class PauseOrder(msgspec.Struct, tag=int(PeerKind.PAUSE), **_WIRE):
    """Coordinator -> every sentinel: pause the engine (reinit: restart it when it is dead,
    hung or cannot pause). Re-sent until its ``OrderDone`` arrives."""

    order_id: int
    epoch: int
    instruction: Instruction


class RecoverOrder(msgspec.Struct, tag=int(PeerKind.RECOVER), **_WIRE):
    order_id: int
    epoch: int


class OrderDone(msgspec.Struct, tag=int(PeerKind.DONE), **_WIRE):
    """A sentinel carried out an order (also its answer to every re-send of it)."""

    sender: int
    order_id: int
    ok: bool = True
    kind: FailureKind = FailureKind.NONE
    info: str | None = None
    # Seconds per phase of what the order took on this engine (spawn, load, kv_cache, graphs,
    # rejoin); what a replacement cost shows here.
    phases: dict[str, float] = {}


class GroupStatus(msgspec.Struct, tag=int(PeerKind.STATUS), **_WIRE):
    """Coordinator -> every sentinel -> its API process: the group's health."""

    epoch: int
    statuses: list[EngineStatus] = []


class GroupFatal(msgspec.Struct, tag=int(PeerKind.FATAL), **_WIRE):
    """Recovery is exhausted: the API processes exit non-zero."""

    epoch: int
    info: str


class ApplyRequest(msgspec.Struct, tag=int(PeerKind.APPLY), **_WIRE):
    """An operator's ``/fault_tolerance/apply`` (API -> its sentinel -> the coordinator)."""

    sender: int
    request_id: str
    instruction: Instruction


class InjectRequest(msgspec.Struct, tag=int(PeerKind.INJECT), **_WIRE):
    """API -> the target engine's sentinel (drills only)."""

    engine: int
    kind: FaultInjection


class SpareState(enum.IntEnum):
    """An engine's warm spare (its worker spares included), as its sentinel sees it."""

    OFF = 0  # --ft-warm-spares 0, or too little host memory for one
    NONE = 1  # none now: the next starts once the engine is up (or a dead one is replaced)
    WARMING = 2  # started, not yet past its imports (a promotion waits for it)
    READY = 3  # waiting for its launch


class EngineProcesses(msgspec.Struct, tag=int(PeerKind.PROCESSES), **_WIRE):
    """A sentinel -> its API process, whenever it changes: the processes behind its engine
    (``/fault_tolerance/status`` shows them; drills kill the serving ones by pid) and the state
    of its warm spare."""

    engine_id: int
    pid: int = 0
    worker_pids: list[int] = []
    spare: SpareState = SpareState.OFF


PeerMessage = (
    PeerHello
    | FaultReport
    | PauseOrder
    | RecoverOrder
    | OrderDone
    | GroupStatus
    | GroupFatal
    | ApplyRequest
    | InjectRequest
    | EngineProcesses
)
