"""The sentinels' own network: rank 0 (the coordinator) binds, the others connect.

tcp:// on the data-parallel address, since in external load-balancer mode the sentinels live
under different ``bastion serve`` processes, possibly on different nodes.
"""

from __future__ import annotations

import logging
import time

import zmq

from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.messages import PeerMessage

logger = logging.getLogger(__name__)


class PeerLink:
    def __init__(self, ctx: zmq.Context, rank: int, host: str, port: int, size: int) -> None:
        self.rank = rank
        self.is_coordinator = rank == 0
        self.identities: dict[int, bytes] = {}
        self.socket = None
        if size == 1:
            return  # a group of one has no peers: bind nothing (no port to collide on)
        if self.is_coordinator:
            self.socket = ctx.socket(zmq.ROUTER)
            self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.socket.bind(f"tcp://{host}:{port}")
        else:
            self.socket = ctx.socket(zmq.DEALER)
            self.socket.setsockopt(zmq.IDENTITY, f"sentinel-{rank}".encode())
            self.socket.connect(f"tcp://{host}:{port}")
        self.socket.setsockopt(zmq.LINGER, 0)

    def to_coordinator(self, msg: PeerMessage) -> None:
        assert not self.is_coordinator
        self.socket.send_multipart(encode(msg))

    def to_peer(self, rank: int, msg: PeerMessage) -> bool:
        """Coordinator only; False when that peer has not said hello (or is gone)."""
        identity = self.identities.get(rank)
        if identity is None:
            return False
        try:
            self.socket.send_multipart([identity, *encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    def receive(self, timeout_s: float) -> list[PeerMessage]:
        out = []
        if self.socket is None:
            time.sleep(timeout_s)
            return out
        if not self.socket.poll(timeout_s * 1000):
            return out
        while self.socket.poll(0):
            frames = self.socket.recv_multipart()
            if self.is_coordinator:
                identity, frames = frames[0], frames[1:]
            kind, msg = decode(frames)
            if kind != MsgKind.PEER:
                continue
            assert isinstance(msg, PeerMessage)
            if self.is_coordinator:
                self.identities[msg.sender] = identity
            out.append(msg)
        return out

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
