"""Rank 0 and its worker processes: one model instance over N ranks, with torch.distributed.

    group = RankGroup.start(config, layout, worker_main)   # spawns ranks 1..N-1 (backend/rank_main.py)
    model = load_model(config, deployment, ..., layout, group.comm)   # rank 0's own shard, meanwhile
    group.wait_ready()
    runner = GroupRunner(group, model, kv)         # backend/runner.py: every rank runs each Forward / Draft
    group.close()                                  # workers exit; the process group is destroyed

Rank 0 is the engine that model.py holds (scheduler, sampler, its own shard). Ranks
1..N-1 are processes it starts (torch.multiprocessing, spawn, one per device, daemonic so they die
with it) and run backend/rank_main.py. Each step rank 0 broadcasts the step's `Forward` (its ForwardBatch as host tensors: token ids,
positions, page tables, compression plans; pickled over a gloo group, with the tensor copies rank 0's prefix
cache asked for around it), and every rank runs it on its own `ModelRunner`: the copies and
`DeepseekV4Model.forward` on its shard and its own copy of the pools, which every rank keeps identical by running
the same writes; only rank 0 samples. Tensor collectives run in the default
group (NCCL on CUDA, gloo on CPU). A worker that dies, or a collective that times out
(`collective_timeout_s`), raises `RankGroupError` on rank 0: the engine then fails what is in flight
and stops serving (see backend/engine.py).

Multi-node: the same code with init_method env:// — MASTER_ADDR, MASTER_PORT (rank 0's host and a
free port), NNODES and NODE_RANK in the environment: node 0 (tritonserver) spawns its ranks 1..P-1
(P = ranks / NNODES), every other node runs `scripts/serve_node.py`, which spawns ranks
NODE_RANK * P .. NODE_RANK * P + P - 1 (docs/parallel.md).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.errors import ConfigError
from backend.model.comm import DistributedCommunicator, RankGroupError
from backend.model.config import config_path
from backend.model.parallel_layout import ParallelLayout
from backend.parallel import node_count
from backend.parallel.data_parallel import RankLinks
from backend.parallel.messages import Stop
from backend.parallel.sync import ALONE, LockStep

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to join the group and build its shard (picklable)."""

    config: EngineConfig
    layout: ParallelLayout
    timeout_s: float
    store_port: int | None = None  # one node: the port of rank 0's rendezvous store (`local_store`); None: env://

    @property
    def init_method(self) -> str:
        """How the ranks meet: env:// (several nodes), else rank 0's store on this node."""
        return "env://" if self.store_port is None else f"tcp://127.0.0.1:{self.store_port}"

    def device(self, rank: int) -> str:
        return f"cuda:{rank % max(1, torch.cuda.device_count())}" if self.config.resolved_device() == "cuda" \
            else "cpu"


IDLE_WAIT_S = 10**8  # (three years)


def join(spec: GroupSpec, rank: int, store: dist.Store | None = None):
    """init_process_group for `rank` (rank 0 of one node passes its `local_store`); returns (communicator for tensors,
    gloo group for the step's batch, how the data-parallel ranks keep in step)."""
    cuda = spec.config.resolved_device() == "cuda"
    if cuda:
        torch.cuda.set_device(spec.device(rank))
    if spec.store_port is not None and store is None:
        store = store_client(spec.store_port, spec.layout.world_size, spec.timeout_s)
        store.add(JOINING_KEY, 1)  # (rank 0 waits for this, watching the workers' processes: `_await_joining`)
    rendezvous = dict(store=store) if store is not None else dict(init_method=spec.init_method)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=spec.layout.world_size,
                            timeout=timedelta(seconds=spec.timeout_s), **rendezvous)
    # The steps' messages go over a gloo group of their own. A worker waits there for rank 0's next message for as
    # long as the server is idle: its wait has no practical limit (rank 0 gone closes the connection, which ends
    # it), where the collective timeout would end an idle group. Rank 0's sends keep the timeout.
    wait_s = spec.timeout_s if rank == 0 else IDLE_WAIT_S
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=wait_s))
    lock_step = spec.layout.data_parallel and spec.layout.moe_exchange  # ranks that meet in every forward
    sync = LockStep(spec.layout.world_size, spec.timeout_s) if lock_step else ALONE
    return DistributedCommunicator(), control, sync


def ready(control, inbox: str | None, config: EngineConfig) -> list[tuple[str | None, dict]]:
    """Every rank has loaded its shard: the ranks' inboxes (data parallelism; else None) and the settings they run
    (`group_settings`), in rank order."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (inbox, group_settings(config)), group=control)
    return every


# Settings a rank may have of its own: paths (each node's own disk), its threads, what only rank 0 does.
PER_NODE_SETTINGS = ("checkpoint", "chat_template", "step_log", "cpu_threads", "max_queue_size", "stop_grace_s",
                     "unload_when_unavailable", "collective_timeout_s")


def group_settings(config: EngineConfig) -> dict:
    """What every rank must run alike: the engine settings but `PER_NODE_SETTINGS`, and the model's config.json (its
    bytes' digest). Another node's ranks build theirs from their own `--set` flags (scripts/serve_node.py)."""
    settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in PER_NODE_SETTINGS}
    # (as they resolve on this node: `auto` here and `cuda` there mean the same; `auto` resolving otherwise does not)
    settings |= {"device": config.resolved_device(), "dtype": str(config.resolved_dtype()),
                 "cuda_graphs": config.resolved_cuda_graphs()}
    path = config_path(config.checkpoint)
    settings["config.json"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return settings


def settings_differences(every: list[dict]) -> str | None:
    """Where a rank's settings differ from rank 0's (ConfigError's message), or None."""
    theirs = [(rank, key, settings.get(key), every[0].get(key)) for rank, settings in enumerate(every)
              for key in sorted(set(settings) | set(every[0])) if settings.get(key) != every[0].get(key)]
    if not theirs:
        return None
    return "the ranks do not run the same settings (every node must be given the same parameters): " + "; ".join(
        f"rank {rank} has {key}={value!r} where rank 0 has {mine!r}" for rank, key, value, mine in theirs[:8])


def check_devices(config: EngineConfig) -> None:
    """ConfigError naming the parameters, before anything is loaded: device=cuda where torch sees no CUDA device, or
    more ranks on this node than it has GPUs (two ranks would share one: NCCL refuses that at its first collective)."""
    if config.resolved_device() != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError("parameter 'device': cuda, but torch sees no CUDA device on this machine")
    layout = ParallelLayout.from_config(config)
    per_node, gpus = ranks_per_node(layout.world_size), torch.cuda.device_count()
    if per_node > gpus:
        raise ConfigError(f"parameters 'tensor_parallel_size', 'expert_parallel_size' and 'data_parallel_size': "
                          f"{per_node} ranks on this node (NNODES={os.environ.get('NNODES', '1')}), but it has "
                          f"{gpus} CUDA device{'s' if gpus != 1 else ''}")


def ranks_per_node(world_size: int) -> int:
    """Ranks each node runs: the world over NNODES (environment; 1 when unset)."""
    nodes = node_count()
    if nodes < 1 or world_size % nodes:
        raise RankGroupError(f"NNODES={nodes} does not divide the {world_size} ranks")
    return world_size // nodes


def spawn_ranks(spec: GroupSpec, first_rank: int, count: int, main: Callable):
    """Start ranks first_rank .. first_rank + count - 1 as daemonic processes (they die with this one), each running
    main(index, spec, first_rank) (backend/rank_main.py)."""
    import torch.multiprocessing as mp

    if count == 0:
        return None
    mp.set_executable(_python())
    return mp.start_processes(main, args=(spec, first_rank), nprocs=count, join=False, daemon=True,
                              start_method="spawn")


# A worker adds 1 here in rank 0's store before it joins the process group: rank 0 waits for them all while it watches
# their processes, so one that fails before it joins is known at once, not after the rendezvous's timeout.
JOINING_KEY = "dsv4/joining"
# How long a worker may take to start (a new interpreter importing torch and the engine: seconds, more on a loaded
# machine) when collective_timeout_s is shorter: its process is watched meanwhile, so a failed one is known at once.
WORKER_START_S = 120.0


def _await_joining(store: dist.TCPStore, context, timeout_s: float) -> None:
    """Return once every worker of this node is joining (RankGroupError, with what ended it, if one is gone first)."""
    processes = context.processes if context is not None else []
    timeout_s = max(timeout_s, WORKER_START_S)
    deadline = time.monotonic() + timeout_s
    while store.add(JOINING_KEY, 0) < len(processes):
        gone = gone_workers(processes, context.error_files)
        if gone:
            raise RankGroupError(f"a worker failed before joining the group: {', '.join(gone)}")
        if time.monotonic() > deadline:
            raise RankGroupError(f"the workers did not start within {timeout_s:g} s (collective_timeout_s, at least "
                                 f"{WORKER_START_S:g} s)")
        time.sleep(0.05)


def gone_workers(processes: list, error_files: list[str | None]) -> list[str]:
    """This node's workers (ranks 1, 2, ...) that no longer run, each with what ended it."""
    return [f"rank {i + 1} ({worker_ending(p, f)})" for i, (p, f) in enumerate(zip(processes, error_files))
            if not p.is_alive()]


def worker_ending(process, error_file: str | None) -> str:
    """What ended a worker process: the last line of the exception it raised (torch's spawn pickles its traceback to
    `error_file`; the whole of it is on the server's standard error too), else its exit code."""
    try:
        with open(error_file, "rb") as file:
            lines = [line for line in str(pickle.load(file)).splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exit code {process.exitcode}"
    except (OSError, TypeError, pickle.UnpicklingError, EOFError):
        return f"exit code {process.exitcode}"


def _kill(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()


def _remove(error_files: list[str | None]) -> None:
    for name in error_files:
        if name:
            Path(name).unlink(missing_ok=True)


def local_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store for a group on one node, on loopback, at a port the OS picks as it binds it: no port
    found free first and bound later, which another process (any client's connection) could take in between."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def store_client(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Another rank's connection to rank 0's `local_store`."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def _python() -> str:
    """The interpreter spawned workers run: this one, unless it is an embedding binary (tritonserver's Python
    backend stub), in which case the repository's venv."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(REPO_ROOT / ".venv" / "bin" / "python")


class RankGroup:
    def __init__(self, spec: GroupSpec, context, control, sync, links: RankLinks | None):
        self.spec, self.control, self.sync, self.links = spec, control, sync, links
        self._processes = context.processes if context is not None else []  # this node's workers
        self._error_files = context.error_files if context is not None else []  # (where a worker's exception goes)
        self.comm = DistributedCommunicator()
        self.broken: str | None = None
        if sync.lock_step:  # (a step that fails on rank 0 breaks the group: its workers go at once)
            sync.end_group = self._kill_workers

    @classmethod
    def start(cls, config: EngineConfig, layout: ParallelLayout, main: Callable) -> "RankGroup":
        """Spawn this node's other ranks, each running `main` (backend/rank_main.py), and join the group as rank 0
        (then load, then `wait_ready`)."""
        store = None if node_count() > 1 else local_store(layout.world_size, config.collective_timeout_s)
        spec = GroupSpec(config, layout, config.collective_timeout_s, store.port if store is not None else None)
        context = spawn_ranks(spec, first_rank=1, count=ranks_per_node(layout.world_size) - 1, main=main)
        try:
            if store is not None:
                _await_joining(store, context, spec.timeout_s)
            _, control, sync = join(spec, 0, store)
        except BaseException:  # (the workers go with rank 0's failure)
            _kill(context.processes if context is not None else [])
            _remove(context.error_files if context is not None else [])
            raise
        return cls(spec, context, control, sync, RankLinks() if layout.data_parallel else None)

    def wait_ready(self) -> None:
        """Return once every worker has loaded its shard (rank 0 loads its own in the meantime); data-parallel ranks'
        inboxes connected."""
        try:
            every = ready(self.control, self.links.address if self.links else None, self.spec.config)
            differences = settings_differences([settings for _, settings in every])
            if differences is None and self.links is not None:
                self.links.connect({rank: inbox for rank, (inbox, _) in enumerate(every) if rank})
        except Exception as exc:
            gone = self._gone(wait_s=5.0)
            self.broken = (f"a worker failed while loading its shard: {', '.join(gone)}" if gone else
                           f"a worker failed while loading its shard: {exc}")
            self.close()
            raise RankGroupError(self.broken) from exc
        if differences is not None:  # (this node's workers wait for a first step: they go now)
            self.broken = differences
            self._kill_workers()
            self.close()
            raise ConfigError(differences)
        logger.info("rank group of %d ready (%s)", self.spec.layout.world_size, self.spec.init_method)

    def run(self, message, run_own):
        """Send every worker `message` (a Forward, a Draft or a DraftChain: backend/runner.py), then run rank 0's part
        (`run_own()`, its result returned); RankGroupError if any rank is gone."""
        if self.broken:
            raise RankGroupError(self.broken)
        try:
            self._check_workers()
            dist.broadcast_object_list([message], src=0, group=self.control)
            return run_own()
        except RankGroupError as exc:  # (rank 0's own collective failed: no step may follow)
            self.broken = self.broken or str(exc)
            raise
        except Exception as exc:  # a collective failed or timed out: the group cannot step again
            self.broken = f"tensor/expert parallel group failed: {exc}"
            raise RankGroupError(self.broken) from exc

    def _kill_workers(self) -> None:
        """End this node's workers now (SIGKILL): their collectives, and every other rank's with them, fail at once."""
        _kill(self._processes)

    def _tell_stop(self) -> None:
        try:
            dist.broadcast_object_list([Stop()], src=0, group=self.control)
        except Exception:  # noqa: BLE001 (a broken group: the workers are terminated)
            pass

    def _check_workers(self) -> None:
        gone = self._gone()
        if gone:  # (a group broken first keeps the first reason: its workers may have gone because of it)
            self.broken = self.broken or f"worker process gone: {', '.join(gone)}"
            raise RankGroupError(self.broken)

    def _gone(self, wait_s: float = 0.0) -> list[str]:
        """gone_workers, waiting up to `wait_s` for one (a worker's connection closes before its process ends)."""
        deadline = time.monotonic() + wait_s
        while not (gone := gone_workers(self._processes, self._error_files)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return gone

    def check(self) -> str | None:
        """Why the group cannot serve (a worker is gone), or None."""
        try:
            self._check_workers()
        except RankGroupError:
            pass
        return self.broken

    def close(self, timeout: float = 30.0, close_links: bool = True) -> None:
        """Tell the workers to exit, wait for them `timeout` seconds in all (terminate stragglers), leave the process
        group; `close_links` False leaves the data-parallel sockets to the process's exit (a thread still polls
        them)."""
        deadline = time.monotonic() + timeout
        if self.links is not None:  # data-parallel ranks listen to their sockets
            self.links.stop_all()
        elif not self.broken:  # (a silent worker would hold the broadcast: it gets the time left, no more)
            telling = threading.Thread(target=self._tell_stop, name="dsv4-stop-workers", daemon=True)
            telling.start()
            telling.join(max(0.0, deadline - time.monotonic()))
        for p in self._processes:
            p.join(max(0.0, deadline - time.monotonic()))
        stragglers = [p for p in self._processes if p.is_alive()]
        for p in stragglers:  # (past the budget: half a second for SIGTERM, all of them together, then SIGKILL)
            p.terminate()
        grace = time.monotonic() + 0.5
        for p in stragglers:
            p.join(max(0.0, grace - time.monotonic()))
            if p.is_alive():  # (SIGTERM ignored, or a stopped process)
                p.kill()
                p.join(5)
        _remove(self._error_files)
        if self.links is not None and close_links:
            self.links.close()
        if dist.is_initialized():
            dist.destroy_process_group()
