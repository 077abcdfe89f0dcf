"""Stateless process groups: torch.distributed collectives without its global state.

``torch.distributed.init_process_group`` can run once per process and cannot be torn down and
rebuilt reliably, yet fault recovery must destroy a group whose peer died and build a new one at
a new port (epoch) in the same, still loaded, processes. So each ``StatelessGroup`` owns its own
``TCPStore`` (hosted by rank 0) and a process group built directly on it; nothing is registered
with ``torch.distributed``, and ``destroy()`` drops both.

Port plan (``ParallelConfig.data_parallel_rpc_port`` = ``base``, ``e = epoch % PORT_EPOCHS``):
- worker groups that span engines (expert parallel with ``data_parallel_size > 1``):
  ``base + 7 + 2 * e`` on ``data_parallel_address`` (``worker_group_port``), so every engine
  derives the same rendezvous without talking; the engines' own CPU group uses
  ``base + 8 + 2 * e`` (``engine_group_port``). The window keeps a daemon that recovers for
  months inside ``base .. base + 8 + 2 * (PORT_EPOCHS - 1)``.
- worker groups inside one engine (TP only): a free local port the executor picks per epoch.

A failed recovery attempt must not hold its peers for the start-up rendezvous time: every process
is up by then, so groups rebuilt at a new epoch wait ``distributed_timeout_s`` for their peers
(``recovery_rendezvous_timeout_s``), and the next attempt moves to the next port (a port taken
by another socket fails the attempt at once).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from bastion.core.config import ConfigError, ParallelConfig
from torch.distributed import PrefixStore, TCPStore

logger = logging.getLogger(__name__)

# A rendezvous waits for peers that may still be starting (another engine's server being
# launched by systemd); collectives afterwards use the much shorter ``timeout_s``.
RENDEZVOUS_TIMEOUT_S = 300.0


class DistributedTimeout(RuntimeError):
    """A collective or a rendezvous did not complete in time (a peer is gone or hung)."""


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS's choice); racy by nature, so callers bind
    it soon after."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


PORT_EPOCHS = 64


def worker_group_port(parallel: ParallelConfig, epoch: int) -> int:
    """The rendezvous port of the cross-engine worker group (EP over all DP x TP workers)."""
    return parallel.data_parallel_rpc_port + 7 + 2 * (epoch % PORT_EPOCHS)


def engine_group_port(parallel: ParallelConfig, epoch: int) -> int:
    """The rendezvous port of the engines' CPU group."""
    return parallel.data_parallel_rpc_port + 8 + 2 * (epoch % PORT_EPOCHS)


def recovery_rendezvous_timeout_s(parallel: ParallelConfig) -> float:
    """How long a group rebuilt during recovery waits for its peers (all already running)."""
    return parallel.distributed_timeout_s


def spans_engines(parallel: ParallelConfig) -> bool:
    """Whether the workers' groups reach across engines (then the port comes from config)."""
    return parallel.enable_expert_parallel and parallel.data_parallel_size > 1


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class StatelessGroup:
    """A process group that lives outside ``torch.distributed``'s global state.

    Build it with ``(backend, host, port, rank, world_size, timeout_s)``: rank 0 hosts the
    ``TCPStore``, the others connect. ``subgroup`` builds further groups over the same store
    under their own ``PrefixStore`` namespace, so one port per epoch serves every group.

    NOTE: every collective is bounded by ``timeout_s`` (gloo's own timeout; NCCL's pg timeout),
    so a dead or hung peer shows up as an exception, never as a hang of this process.
    """

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int,
                 timeout_s: float, *, name: str = "world",
                 rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S,
                 _store: dist.Store | None = None, _ranks: list[int] | None = None) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl; got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.backend, self.host, self.port = backend, host, port
        self.rank, self.world_size, self.timeout_s, self.name = rank, world_size, timeout_s, name
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.ranks = _ranks or list(range(world_size))  # members, as ranks of the root group
        self.is_master = _store is None and rank == 0
        self._owns_store = _store is None
        if _store is None:
            _store = _connect_store(host, port, rank, world_size, rendezvous_timeout_s)
        self.store: dist.Store | None = _store
        prefixed = PrefixStore(f"{name}/", _store)
        _wait_for_all(prefixed, rank, world_size, rendezvous_timeout_s, name)
        self.pg: dist.ProcessGroup | None = _make_process_group(
            backend, prefixed, rank, world_size, timeout_s, rendezvous_timeout_s)

    def subgroup(self, name: str, ranks: list[int]) -> StatelessGroup | None:
        """A group of ``ranks`` (ranks of this group) over the same store; every member of
        this group must call it (in the same order), non-members get ``None``."""
        if self.store is None:
            raise RuntimeError(f"group {self.name} is destroyed")
        if self.rank not in ranks:
            return None
        return StatelessGroup(self.backend, self.host, self.port, ranks.index(self.rank),
                              len(ranks), self.timeout_s, name=f"{self.name}.{name}",
                              rendezvous_timeout_s=self.rendezvous_timeout_s,
                              _store=self.store, _ranks=[self.ranks[r] for r in ranks])

    # ----------------------------------------------------------------------- collectives

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(_timedelta(self.timeout_s))
        except Exception as exc:  # gloo raises on timeout and on a closed peer connection
            raise DistributedTimeout(f"{what} on group {self.name} (rank {self.rank} of "
                                     f"{self.world_size}) failed within {self.timeout_s:.0f} s: "
                                     f"{exc}") from exc

    def _live_pg(self, what: str) -> dist.ProcessGroup:
        if self.pg is None:
            raise RuntimeError(f"{what} on destroyed group {self.name}")
        return self.pg

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or ``op="max"``: the maximum) over ranks, in place."""
        if self.world_size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            self._wait(self._live_pg("all_reduce").allreduce([x], opts), "all_reduce")
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Equally shaped ``x`` of every rank, concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._wait(self._live_pg("all_gather").allgather([parts], [x.contiguous()]),
                   "all_gather")
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of rank ``src`` on every rank, in place."""
        if self.world_size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = src, 0
            self._wait(self._live_pg("broadcast").broadcast([x], opts), "broadcast")
        return x

    def barrier(self) -> None:
        # An all-reduce of one element: a real round trip with the group's own timeout.
        self.all_reduce(torch.zeros(1, device=self.device))

    @property
    def device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def destroy(self) -> None:
        """Release the process group and the store (idempotent; safe after a peer died)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            for method in ("abort", "shutdown"):  # NCCL: abort frees communicators at once
                if self.backend == "nccl" and hasattr(pg, method):
                    try:
                        getattr(pg, method)()
                        break
                    except Exception:  # the group is being dropped; nothing to save
                        logger.debug("group %s: %s failed", self.name, method, exc_info=True)
            del pg
        # NOTE: the master's TCPStore server closes its port when the last reference goes.
        self.store = None

    def __repr__(self) -> str:
        state = "destroyed" if self.pg is None else f"{self.host}:{self.port}"
        return (f"StatelessGroup({self.name}, {self.backend}, rank {self.rank}/"
                f"{self.world_size}, {state})")


def _connect_store(host: str, port: int, rank: int, world_size: int,
                   timeout_s: float) -> dist.Store:
    """Rank 0 hosts the store, the others connect to it, each within ``timeout_s``.

    # NOTE: a client's TCPStore constructor ignores its timeout once some other program's socket
    accepts the connection and never answers (seen in a recovery whose port another socket
    held: 45 s and more). So a client connects on a helper thread (torch releases the GIL) and
    gives up when the timeout passes; the thread ends when that socket closes.
    """
    role = "host" if rank == 0 else "reach"

    def failure(reason: object) -> DistributedTimeout:
        return DistributedTimeout(f"rank {rank} could not {role} the rendezvous at "
                                  f"{host}:{port} within {timeout_s:.0f} s: {reason}")

    def connect() -> dist.Store:
        return TCPStore(host, port, world_size, rank == 0, timeout=_timedelta(timeout_s),
                        wait_for_workers=False)

    if rank == 0:
        try:
            return connect()
        except Exception as exc:
            raise failure(exc) from exc
    outcome: list[tuple[dist.Store | None, BaseException | None]] = []

    def attempt() -> None:
        try:
            outcome.append((connect(), None))
        except Exception as exc:  # noqa: BLE001 (handed to the waiting thread)
            outcome.append((None, exc))

    thread = threading.Thread(target=attempt, daemon=True, name=f"store-connect-{port}")
    thread.start()
    thread.join(timeout_s + 1.0)
    if not outcome:
        raise failure("connected, but no answer (is another program listening on that port?)")
    store, exc = outcome[0]
    if store is None:
        raise failure(exc) from exc
    return store


def _wait_for_all(store: dist.Store, rank: int, world_size: int, timeout_s: float,
                  name: str) -> None:
    """Return once every rank has arrived: a lower rank's process group can be built before
    its peers exist, and its first collective would then spend its short timeout waiting."""
    store.set(f"arrived/{rank}", b"1")
    try:
        store.wait([f"arrived/{r}" for r in range(world_size)], _timedelta(timeout_s))
    except Exception as exc:
        raise DistributedTimeout(f"group {name}: not every one of {world_size} ranks arrived "
                                 f"within {timeout_s:.0f} s: {exc}") from exc


def _make_process_group(backend: str, store: dist.Store, rank: int, world_size: int,
                        timeout_s: float, rendezvous_timeout_s: float) -> dist.ProcessGroup:
    # Joining waits for slow peers (rendezvous timeout); later collectives get ``timeout_s``.
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(store, rank, world_size, _timedelta(rendezvous_timeout_s))
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _timedelta(rendezvous_timeout_s)
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        # NCCL connects lazily; bind the device now so the first collective does not pick one.
        pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    pg.set_timeout(_timedelta(timeout_s))
    return pg


# ------------------------------------------------------------------------ worker topology


class WorkerGroups(NamedTuple):
    """One worker's groups at one epoch; ``ep`` is ``None`` without expert parallelism."""

    root: StatelessGroup  # every worker that shares the rendezvous
    tp: StatelessGroup
    ep: StatelessGroup | None

    def destroy(self) -> None:
        for group in (self.ep, self.tp, self.root):
            if group is not None:
                group.destroy()


def build_worker_groups(parallel: ParallelConfig, backend: str, host: str, port: int,
                        dp_rank: int, tp_rank: int, timeout_s: float | None = None,
                        rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> WorkerGroups:
    """TP group among one engine's workers; EP group over all ``dp_size * tp_size`` workers.

    With a group that spans engines the rendezvous holds every worker of every engine
    (global rank ``dp_rank * tp_size + tp_rank``); otherwise only this engine's workers.
    """
    tp_size, dp_size = parallel.tensor_parallel_size, parallel.data_parallel_size
    timeout_s = parallel.distributed_timeout_s if timeout_s is None else timeout_s
    start = time.perf_counter()
    if spans_engines(parallel):
        root = StatelessGroup(backend, host, port, dp_rank * tp_size + tp_rank,
                              dp_size * tp_size, timeout_s, name="workers",
                              rendezvous_timeout_s=rendezvous_timeout_s)
        tp_groups = [root.subgroup(f"tp{d}", list(range(d * tp_size, (d + 1) * tp_size)))
                     for d in range(dp_size)]
        tp = tp_groups[dp_rank]
        ep = root.subgroup("ep", list(range(dp_size * tp_size)))
    else:
        root = StatelessGroup(backend, host, port, tp_rank, tp_size, timeout_s,
                              name=f"workers{dp_rank}",
                              rendezvous_timeout_s=rendezvous_timeout_s)
        tp = root.subgroup("tp", list(range(tp_size)))
        ep = root.subgroup("ep", list(range(tp_size))) if parallel.enable_expert_parallel else None
    assert tp is not None
    logger.info("worker %d-%d: groups at %s:%d ready in %.2f s (tp %d, ep %s)", dp_rank,
                tp_rank, host, port, time.perf_counter() - start, tp.world_size,
                ep.world_size if ep is not None else "off")
    return WorkerGroups(root, tp, ep)


def check_parallel_divisibility(hf_config: object, parallel: ParallelConfig) -> None:
    """Fail at start-up, naming the counts, when the model cannot be split as asked."""
    tp = parallel.tensor_parallel_size
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    problems = []
    if heads is not None and heads % tp:
        problems.append(f"num_attention_heads ({heads}) is not divisible by "
                        f"tensor_parallel_size ({tp})")
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}) and tensor_parallel_size ({tp}) "
                        "do not divide one another")
    num_experts = getattr(hf_config, "num_experts", None) or 0
    if parallel.enable_expert_parallel and num_experts:
        ep = parallel.world_size
        if num_experts % ep:
            problems.append(f"num_experts ({num_experts}) is not divisible by the expert "
                            f"parallel size ({ep} = tensor x data parallel)")
    if problems:
        raise ConfigError("cannot split the model: " + "; ".join(problems)
                          + ". Use a tensor_parallel_size that divides the head counts.")
