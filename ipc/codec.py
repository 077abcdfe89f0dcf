"""Framing: a one-byte kind frame, then the msgpack body of its struct.

NOTE: there is no pickle anywhere on a socket; a frame that does not decode as the struct its
kind names is rejected with ``msgspec.DecodeError``.
"""

from __future__ import annotations

import enum
import typing

import msgspec

from bastion.ipc import control as c
from bastion.ipc import messages as m


class MsgKind(enum.IntEnum):
    ADD = 1
    ABORT = 2
    UTILITY = 3
    OUTPUTS = 4
    STATUS = 5
    EXECUTE = 6
    RUNNER_OUTPUT = 7
    HELLO = 8
    HANDSHAKE = 9
    READY = 10
    FAILURE = 11
    WORKER_CALL = 12
    WORKER_REPLY = 13
    SHUTDOWN = 14
    CONTROL = 15
    CONTROL_REPLY = 16
    PEER = 17


_TYPES: dict[MsgKind, type] = {
    MsgKind.ADD: m.EngineCoreRequest,
    MsgKind.ABORT: m.AbortRequests,
    MsgKind.UTILITY: m.UtilityCall,
    MsgKind.OUTPUTS: m.EngineCoreOutputs,
    MsgKind.STATUS: m.EngineStatus,
    MsgKind.EXECUTE: m.SchedulerOutput,
    MsgKind.RUNNER_OUTPUT: m.ModelRunnerOutput,
    MsgKind.HELLO: m.Hello,
    MsgKind.HANDSHAKE: c.HandshakeInfo,
    MsgKind.READY: m.Ready,
    MsgKind.FAILURE: m.Failure,
    MsgKind.WORKER_CALL: m.WorkerCall,
    MsgKind.WORKER_REPLY: m.WorkerReply,
    MsgKind.SHUTDOWN: m.AbortRequests,  # body unused
    MsgKind.CONTROL: c.EngineCommand,
    MsgKind.CONTROL_REPLY: c.EngineControlReply,
    MsgKind.PEER: c.PeerMessage,
}
# NOTE: a tagged union's kind is that of every member; the tag inside the body names the member.
_KIND_OF = {member: kind for kind, tp in _TYPES.items() if kind != MsgKind.SHUTDOWN
            for member in typing.get_args(tp) or (tp,)}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPES.items()}
_KIND_BYTES = {kind: bytes([kind]) for kind in MsgKind}


def encode(msg: msgspec.Struct, kind: MsgKind | None = None) -> list[bytes]:
    kind = kind if kind is not None else _KIND_OF[type(msg)]
    return [_KIND_BYTES[kind], _ENCODER.encode(msg)]


def decode(frames: list[bytes] | list[memoryview]) -> tuple[MsgKind, msgspec.Struct]:
    if len(frames) < 2 or len(frames[0]) != 1:
        raise msgspec.DecodeError("expected a one-byte kind frame and a body")
    kind = MsgKind(frames[0][0])
    return kind, _DECODERS[kind].decode(frames[1])


def shutdown_frames() -> list[bytes]:
    return encode(m.AbortRequests([]), MsgKind.SHUTDOWN)
