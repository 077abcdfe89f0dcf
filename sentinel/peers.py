"""The sentinels' own network: rank 0 (the coordinator) binds, the others connect.

tcp:// on the data-parallel address, since in external load-balancer mode the sentinels live
under different ``bastion serve`` processes, possibly on different nodes. A message to this
sentinel's own rank goes through a local queue, so rank 0 hears the coordinator (and the
coordinator hears rank 0) exactly as every other rank does.
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import PeerMessage

logger = logging.getLogger(__name__)


class PeerLink:
    def __init__(self, ctx: zmq.Context, rank: int, host: str, port: int, size: int) -> None:
        """``size``: the sentinels of this recovery group; 1 (a dense engine, or DP=1) makes
        this sentinel its own coordinator, with no socket at all (no port to collide on)."""
        self.rank = rank
        self.is_coordinator = rank == 0 or size == 1
        self.identities: dict[int, bytes] = {}
        self.loopback: collections.deque[PeerMessage] = collections.deque()
        self.socket = None
        if size == 1:
            return
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
        if self.is_coordinator:
            self.loopback.append(msg)
        else:
            self.socket.send_multipart(encode(msg))

    def to_peer(self, rank: int, msg: PeerMessage) -> bool:
        """Coordinator only; False when that peer has not said hello (or is gone): the
        coordinator re-sends what matters."""
        if rank == self.rank:
            self.loopback.append(msg)
            return True
        identity = self.identities.get(rank)
        if identity is None:
            return False
        try:
            self.socket.send_multipart([identity, *encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    def receive(self, timeout_s: float) -> list[PeerMessage]:
        out = list(self.loopback)
        self.loopback.clear()
        if out:
            timeout_s = 0.0
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
            sender = getattr(msg, "sender", None)
            if self.is_coordinator and sender is not None:
                self.identities[sender] = identity
            out.append(msg)
        return out

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
