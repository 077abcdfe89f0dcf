"""A sentinel's handle on its engine process: start it, watch it, command it, restart it.

Nothing here blocks the sentinel's loop but the first start: a restart runs its spawn and
handshake on a thread (``begin_start`` / ``start_finished``), and a command is sent and its
reply collected later (``send`` / ``result``), re-sent until it is answered.

NOTE: every start is a new *incarnation*; the engine's replies carry it, and a reply of an
older incarnation (still queued when it was killed) is dropped. Taking the old engine's
socket identity for the new one's sent orders into the void: the 120 s hang of issue #24.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import threading
import time
from dataclasses import dataclass

import zmq

from bastion.core.config import MAX_WARM_SPARES, EngineConfig
from bastion.ipc.codec import MsgKind, decode, encode
from bastion.ipc.control import (
    EngineCommand,
    EngineFault,
    EngineLaunch,
    EngineProcesses,
    EngineReply,
    HandshakeInfo,
    Heartbeat,
    SentinelLaunch,
    ShutdownEngine,
    SpareState,
)
from bastion.ipc.messages import FailureKind
from bastion.procs.lifecycle import (
    Child,
    HandshakeServer,
    Spares,
    SpareSettings,
    encode_config,
    ipc_address,
    spawn_child,
)

logger = logging.getLogger(__name__)

RESEND_S = 1.0
_SPARE_RETRY_S = 5.0
# An idle spare engine and its worker spares hold torch and bastion imported (measured on CPU:
# about 0.3 GiB each process, docs/FAULTS.md); leave room for the serving processes too.
_SPARE_MIN_HOST_BYTES = 2 * 2**30


def host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class _Sent:
    command: EngineCommand
    sent_at: float


class EngineHandle:
    """Owns the engine child process and the sentinel end of its control channel."""

    def __init__(
        self, ctx: zmq.Context, config: EngineConfig, engine_id: int, launch: SentinelLaunch
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.engine_id = engine_id
        self.launch = launch
        self.runtime_dir = launch.runtime_dir
        self.control_address = ipc_address(self.runtime_dir, f"engine{engine_id}-control")
        self.control = ctx.socket(zmq.ROUTER)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(self.control_address)
        self.peer_identity: bytes | None = None
        self.child: Child | None = None
        self.incarnation = 0
        self.epoch = 0  # the epoch the engine runs at (or was started for)
        self._seq = itertools.count(1)
        self.last_reply: EngineReply | None = None
        self.last_reply_time = 0.0
        self.faults: list[EngineFault] = []
        self.num_blocks: int | None = None  # measured at the first start, reused on restarts
        self._sent: dict[int, _Sent] = {}
        self._results: dict[int, EngineReply] = {}
        self._starter: threading.Thread | None = None
        self.is_up = False  # started, READY and announced (until the next start)
        self.spares: list[Spares] = []  # warm spare engines (each with its worker spares)
        self.num_spares_started = 0
        self._spare_lost_at = -1e9  # when a spare last died soon after its start
        self.promoted = False  # the last start promoted a spare
        self.worker_pids: list[int] = []  # of the running incarnation, once it is READY
        self._spares_that_fit = MAX_WARM_SPARES  # fewer once host memory ran short (0: none)
        self._start_error: BaseException | None = None
        self.start_phases: dict[str, float] = {}

    # ------------------------------------------------------------------------ lifecycle

    def start(self, epoch: int, start_paused: bool, timeout_s: float) -> None:
        """Spawn the engine (it spawns its workers), wait for READY and its control channel."""
        self.begin_start(epoch, start_paused, timeout_s)
        self._starter.join()
        deadline = time.monotonic() + 5.0
        while not self.start_finished():
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.engine_id} did not open its control channel")
            self.poll(0.05)

    def begin_start(self, epoch: int, start_paused: bool, timeout_s: float) -> None:
        """Start a new incarnation; ``start_finished`` says when it is up.

        NOTE: the process is spawned here, on the loop's thread, and only its handshake runs
        on a helper thread: a child's parent-death signal fires when the *thread* that forked
        it exits, so a child spawned by the helper would be killed as soon as it was ready."""
        self.incarnation += 1
        self.epoch = epoch
        self.faults.clear()  # the previous incarnation's
        self.peer_identity = None
        self.is_up = False
        self._sent.clear()
        self._results.clear()
        self._start_error = None
        self.start_phases = {}
        launch = EngineLaunch(
            self.launch.input,
            self.launch.output,
            self.control_address,
            self.runtime_dir,
            epoch,
            start_paused,
            self.num_blocks,
            self.incarnation,
        )
        t0 = time.perf_counter()
        info = HandshakeInfo(encode_config(self.config), launch, self.engine_id)
        spare = self._take_spare()
        self.worker_pids = []
        self.promoted = spare is not None and spare.is_alive()
        if self.promoted:
            # NOTE: a spare still warming up is promoted all the same: it is ahead of a
            # process started now (a fault soon after the last one finds it so).
            if not spare.poll():
                logger.warning("sentinel %d: promoting the warm spare while it is still "
                               "warming up (started %.1f s ago)", self.engine_id,
                               time.monotonic() - spare.started_at)
            self.child = spare.children[0]
            run = spare.promote
        else:
            if spare is not None:
                spare.kill()
            handshake = HandshakeServer(self.ctx, ipc_address(
                self.runtime_dir, f"engine{self.engine_id}-hs-{launch.incarnation}"))
            self.child = spawn_child("engine", self.engine_id,
                                     f"bastion::engine-{self.engine_id}", handshake.address)

            def run(infos: dict, timeout_s: float) -> dict:
                try:
                    return handshake.run([self.child], infos, timeout_s)
                finally:
                    handshake.close()
        self._starter = threading.Thread(target=self._run_handshake,
                                         args=(run, info, timeout_s, t0,
                                               spare if self.promoted else None),
                                         daemon=True, name="engine-start")
        self._starter.start()

    def _run_handshake(self, run, info: HandshakeInfo, timeout_s: float, t0: float,
                       spare: Spares | None) -> None:
        try:
            ready = run({self.engine_id: info}, timeout_s)[self.engine_id]
            timings = ready.info
            self.num_blocks = self.num_blocks or timings.get("num_blocks")
            self.worker_pids = list(ready.child_pids)
            total = time.perf_counter() - t0
            phases = {
                name: timings.get(f"{name}_ms", 0) / 1000 for name in ("load", "kv_cache", "graphs")
            }
            # Waiting for a promoted spare to finish warming up is its own phase.
            wait = {"spare_wait": spare.waited_s} if spare is not None and spare.waited_s else {}
            if wait:
                logger.warning("sentinel %d: the promoted spare was warm %.1f s after its "
                               "promotion", self.engine_id, spare.waited_s)
            self.start_phases = {
                **wait,
                "spawn_or_promote": max(0.0, total - sum(phases.values()) - sum(wait.values())),
                **phases,
            }
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which reports it
            self._start_error = exc

    def _take_spare(self) -> Spares | None:
        """The spare to promote: a warm one if any (the oldest), else the one warming longest;
        dead ones are dropped."""
        for spare in [s for s in self.spares if not s.is_alive()]:
            spare.kill()
            self.spares.remove(spare)
        if not self.spares:
            return None
        warm = [s for s in self.spares if s.poll()]
        spare = min(warm or self.spares, key=lambda s: s.started_at)
        self.spares.remove(spare)
        return spare

    def keep_spare(self) -> None:
        """Keep ``ft_warm_spares`` warm spares while the engine is up: start one as soon as
        there are fewer (so right after a promotion, once the promoted engine is READY; one at
        a time, the next once the last is warm, so spares never compete with each other for
        the host), note when each is warm, and replace one that died idle; serving is never
        touched. A spare that died within ``_SPARE_RETRY_S`` of its start is replaced that
        long after its death (no crash loop)."""
        wanted = min(self.config.fault_tolerance.ft_warm_spares, self._spares_that_fit)
        if wanted < 1 or not self.is_up:
            return
        now = time.monotonic()
        for spare in list(self.spares):
            if spare.is_alive():
                if spare.ready_at is None and spare.poll():
                    logger.info("sentinel %d: warm spare ready %.1f s after its start",
                                self.engine_id, spare.ready_at - spare.started_at)
                continue
            codes = [c.proc.poll() for c in spare.children]
            logger.warning("sentinel %d: the idle warm spare exited (code %s); starting "
                           "another", self.engine_id, codes[0])
            spare.kill()
            self.spares.remove(spare)
            if now - spare.started_at < _SPARE_RETRY_S:
                self._spare_lost_at = now
        if len(self.spares) >= wanted or any(s.ready_at is None for s in self.spares):
            return
        if now - self._spare_lost_at < _SPARE_RETRY_S:
            return
        available = host_memory_available()
        if available is not None and available < _SPARE_MIN_HOST_BYTES:
            logger.warning("sentinel %d: %s: %.1f GiB of host memory available, a spare needs "
                           "%.1f GiB", self.engine_id, "no warm spare" if not self.spares else
                           f"keeping {len(self.spares)} warm spare(s), not {wanted}",
                           available / 2**30, _SPARE_MIN_HOST_BYTES / 2**30)
            self._spares_that_fit = len(self.spares)
            return
        self.num_spares_started += 1
        tp = self.config.parallel.tensor_parallel_size
        settings = SpareSettings(f"bastion::engine-{self.engine_id}", self.config.model.device,
                                 tp, self.runtime_dir, self.engine_id, tp,
                                 encode_config(self.config).decode())
        self.spares.append(Spares(self.ctx, ipc_address(
            self.runtime_dir, f"engine{self.engine_id}-spare-{self.num_spares_started}"),
            "engine", {self.engine_id: settings}))

    def spare_state(self) -> SpareState:
        """The best spare's state: ready if one is warm, else warming, else none."""
        if self.config.fault_tolerance.ft_warm_spares < 1 or self._spares_that_fit == 0:
            return SpareState.OFF
        alive = [s for s in self.spares if s.is_alive()]
        if not alive:
            return SpareState.NONE
        return SpareState.READY if any(s.ready_at is not None for s in alive) else (
            SpareState.WARMING)

    def processes(self) -> EngineProcesses:
        """The serving processes (no pid while the engine is down) and the spare's state."""
        pid = self.child.proc.pid if self.is_alive() else 0
        return EngineProcesses(self.engine_id, pid, self.worker_pids if pid else [],
                               self.spare_state())

    @property
    def is_starting(self) -> bool:
        return self._starter is not None and self._starter.is_alive()

    def start_finished(self) -> bool:
        """True once the started engine is READY and has announced itself; raises what the
        start failed with."""
        if self.is_starting:
            return False
        if self._start_error is not None:
            error, self._start_error = self._start_error, None
            raise error
        if self.peer_identity is None and self.is_alive():
            return False
        if not self.is_up:
            self.is_up = True
            self.last_reply_time = time.monotonic()
        return True

    def is_alive(self) -> bool:
        return self.child is not None and self.child.is_alive()

    def exit_code(self) -> int | None:
        return None if self.child is None else self.child.proc.poll()

    def kill(self) -> None:
        """SIGKILL the engine; its workers follow it (they die with their parent)."""
        if self.child is not None and self.child.is_alive():
            self.child.proc.kill()
            self.child.proc.wait()
        time.sleep(0.2)  # let the workers' parent-death signal land before ports are reused

    def stop(self, timeout_s: float = 10.0) -> None:
        for spare in self.spares:
            spare.kill()
        if self.is_alive() and (self.is_starting or self.peer_identity is None):
            # Not serving (a start in progress, or one given up on: a dead group's last
            # attempt may still be importing when the server exits), so nothing to drain.
            # SIGKILL: a SIGTERM landing inside its imports takes seconds to unwind.
            self.child.proc.kill()
            self.child.proc.wait()
        if self._starter is not None:
            self._starter.join(timeout_s)
        if not self.is_alive():
            return
        self.send(ShutdownEngine(0), track=False)
        try:
            self.child.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.child.kill(timeout=2.0)

    # --------------------------------------------------------------------------- control

    def send(self, command: EngineCommand, track: bool = True) -> int:
        """Send ``command`` under a new ``seq`` (returned); a tracked command is re-sent
        until answered and its reply kept for ``result``."""
        command.seq = next(self._seq)
        if track:
            self._sent[command.seq] = _Sent(command, time.monotonic())
        self._transmit(command)
        return command.seq

    def _transmit(self, command: EngineCommand) -> None:
        if self.peer_identity is not None:
            self.control.send_multipart([self.peer_identity, *encode(command)])

    def result(self, seq: int) -> EngineReply | None:
        """The reply to ``send``'s ``seq``, once it arrived (then forgotten)."""
        return self._results.pop(seq, None)

    def resend(self, now: float) -> None:
        for sent in self._sent.values():
            if now - sent.sent_at >= RESEND_S:
                sent.sent_at = now
                self._transmit(sent.command)

    def poll(self, timeout_s: float) -> None:
        """Receive whatever the engine said: replies, its announcement, fault reports."""
        if not self.control.poll(timeout_s * 1000):
            return
        while self.control.poll(0):
            identity, *frames = self.control.recv_multipart()
            kind, msg = decode(frames)
            if kind != MsgKind.CONTROL_REPLY or msg.incarnation != self.incarnation:
                continue  # a message of an engine that was replaced
            if isinstance(msg, EngineFault):
                self.faults.append(msg)
                continue
            self.peer_identity = identity
            self.last_reply, self.last_reply_time = msg, time.monotonic()
            self.epoch = msg.epoch
            if self._sent.pop(msg.seq, None) is not None:
                self._results[msg.seq] = msg

    def heartbeat(self) -> None:
        if self.peer_identity is not None and self.is_alive():
            self._transmit(Heartbeat(next(self._seq)))

    def busy_for(self) -> float:
        """How long the engine has been inside one step, by its last heartbeat."""
        reply = self.last_reply
        if reply is None:
            return 0.0
        return reply.busy_for_s + (
            time.monotonic() - self.last_reply_time if reply.busy_for_s > 0 else 0.0
        )

    def check(self, hang_timeout_s: float) -> tuple[FailureKind, str] | None:
        """A fault, if one is visible: a dead process, a report, or a hang. Nothing while a
        start is in progress (its order reports how it ends)."""
        if not self.is_up:
            return None
        if self.child is not None and not self.child.is_alive():
            return (
                FailureKind.PROCESS_EXIT,
                f"engine {self.engine_id} process exited with code {self.exit_code()}",
            )
        while self.faults:
            # NOTE: the engine may report one fault twice (its busy loop and its control
            # thread both see a dead worker). A second report still queued when the recovery
            # began must not fault the next incarnation: once in 50 rounds of the stress drill
            # it restarted a freshly recovered engine.
            fault = self.faults.pop(0)
            if fault.incarnation == self.incarnation and fault.epoch >= self.epoch:
                return fault.kind, fault.info
        now = time.monotonic()
        if now - self.last_reply_time > hang_timeout_s:
            return FailureKind.HANG, f"engine {self.engine_id} stopped answering heartbeats (hang)"
        reply = self.last_reply
        if reply is not None and reply.busy_for_s > hang_timeout_s:
            return FailureKind.HANG, (
                f"engine {self.engine_id} made no progress for "
                f"{reply.busy_for_s:.1f} s (hang: a step or collective "
                "is stuck)"
            )
        return None

    def close(self) -> None:
        self.control.close(linger=0)
