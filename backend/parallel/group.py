"""Rank 0 and its worker processes: one model instance over N ranks, with torch.distributed.

    group = RankGroup.start(config, layout)        # spawns ranks 1..N-1, each loads its shard
    model = load_model(config, deployment, ..., layout, group.comm)   # rank 0's own shard, meanwhile
    group.wait_ready()
    runner = GroupRunner(group, model, kv)         # backend/runner.py: every rank runs each Forward / Draft
    group.close()                                  # workers exit; the process group is destroyed

Rank 0 is the engine that model.py holds (scheduler, sampler, its own shard). Ranks
1..N-1 are processes it starts (torch.multiprocessing, spawn, one per device, daemonic so they die
with it). Each step rank 0 broadcasts the step's `Forward` (its ForwardBatch as host tensors: token ids,
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

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from backend.config import EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.parallel.comm import DistributedCommunicator
from backend.parallel.layout import ParallelLayout
from backend.runner import Draft, Forward, ModelRunner, StepCopies, Stop

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


class RankGroupError(RuntimeError):
    """A worker died or a collective failed: this model instance cannot run another step."""


@dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to join the group and build its shard (picklable)."""

    config: EngineConfig
    layout: ParallelLayout
    init_method: str
    timeout_s: float

    def device(self, rank: int) -> str:
        return f"cuda:{rank % max(1, torch.cuda.device_count())}" if self.config.resolved_device() == "cuda" \
            else "cpu"


def _join(spec: GroupSpec, rank: int):
    """init_process_group for `rank`; returns (communicator for tensors, gloo group for the step's batch)."""
    cuda = spec.config.resolved_device() == "cuda"
    if cuda:
        torch.cuda.set_device(spec.device(rank))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=spec.init_method, rank=rank,
                            world_size=spec.layout.world_size, timeout=timedelta(seconds=spec.timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.timeout_s)) if cuda else None
    return DistributedCommunicator(), control


@dataclass(frozen=True, slots=True)
class DataParallelForward:
    """Data-parallel ranks' lock-step forward: each rank's batch (or None) and copies follow, scattered."""


def _worker_main(index: int, spec: GroupSpec, first_rank: int) -> None:
    """A worker rank (process `index` of its node is rank first_rank + index): join, load the shard, then run
    every message rank 0 broadcasts (`Forward`, `Draft`) on its own ModelRunner until `Stop`."""
    rank = first_rank + index
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(max(1, (spec.config.cpu_threads or torch.get_num_threads()) // spec.layout.world_size))
    comm, control = _join(spec, rank)
    layout = ParallelLayout.from_config(spec.config, rank)
    device = spec.device(rank)
    config, dtype = spec.config, spec.config.resolved_dtype()
    deployment = plan_deployment(config, device, dtype)  # the same pools as rank 0
    model = load_model(config, deployment, device, dtype, layout, comm)
    runner = ModelRunner(model, deployment.kv, keep_streams=bool(config.num_speculative_tokens))
    dist.barrier(group=control)  # loaded
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        match message[0]:
            case Forward() as step:
                runner.forward(step)
            case Draft() as step:
                runner.draft(step)
            case DataParallelForward():  # this rank's own batch (or none) follows, scattered
                mine = [None]
                dist.scatter_object_list(mine, None, src=0, group=control)
                logits = _data_parallel_step(runner, *mine[0])
                dist.gather_object(None if logits is None else logits.cpu(), None, dst=0, group=control)
            case Stop():
                break
    dist.destroy_process_group()


def _data_parallel_step(runner: ModelRunner, batch, copies: StepCopies, counts):
    """One data-parallel rank's part of a step: its own batch's forward (logits for its own rows) with the prefix
    cache's copies around it, or, without a batch, its part of the MoE exchanges alone."""
    if batch is None:
        return runner.model.idle_forward(counts)
    return runner.forward(Forward(batch, copies))[0]


def ranks_per_node(world_size: int) -> int:
    """Ranks each node runs: the world over NNODES (environment; 1 when unset)."""
    nodes = int(os.environ.get("NNODES", "1"))
    if nodes < 1 or world_size % nodes:
        raise RankGroupError(f"NNODES={nodes} does not divide the {world_size} ranks")
    return world_size // nodes


def spawn_ranks(spec: GroupSpec, first_rank: int, count: int):
    """Start ranks first_rank .. first_rank + count - 1 as daemonic processes (they die with this one)."""
    import torch.multiprocessing as mp

    if count == 0:
        return None
    mp.set_executable(_python())
    return mp.start_processes(_worker_main, args=(spec, first_rank), nprocs=count, join=False, daemon=True,
                              start_method="spawn")


def run_node(config: EngineConfig, node_rank: int) -> None:
    """Another node's ranks (scripts/serve_node.py): spawn them, wait until rank 0 ends the group."""
    layout = ParallelLayout.from_config(config)
    per_node = ranks_per_node(layout.world_size)
    if not os.environ.get("MASTER_ADDR") or not 0 < node_rank < layout.world_size // per_node:
        raise RankGroupError("a worker node needs MASTER_ADDR / MASTER_PORT and 0 < NODE_RANK < NNODES")
    spec = GroupSpec(config, layout, "env://", config.collective_timeout_s)
    context = spawn_ranks(spec, first_rank=node_rank * per_node, count=per_node)
    while not context.join():  # raises if a rank fails; True once all exited
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _python() -> str:
    """The interpreter spawned workers run: this one, unless it is an embedding binary (tritonserver's Python
    backend stub), in which case the repository's venv."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    return str(REPO_ROOT / ".venv" / "bin" / "python")


class RankGroup:
    def __init__(self, spec: GroupSpec, context, control):
        self.spec, self.control = spec, control
        self._processes = context.processes if context is not None else []  # this node's workers
        self.comm = DistributedCommunicator()
        self.broken: str | None = None

    @classmethod
    def start(cls, config: EngineConfig, layout: ParallelLayout) -> "RankGroup":
        """Spawn this node's other ranks and join the group as rank 0 (then load, then `wait_ready`)."""
        init_method = "env://" if os.environ.get("MASTER_ADDR") else f"tcp://127.0.0.1:{_free_port()}"
        spec = GroupSpec(config, layout, init_method, config.collective_timeout_s)
        context = spawn_ranks(spec, first_rank=1, count=ranks_per_node(layout.world_size) - 1)
        _, control = _join(spec, 0)
        return cls(spec, context, control)

    def wait_ready(self) -> None:
        """Return once every worker has loaded its shard (rank 0 loads its own in the meantime)."""
        try:
            dist.barrier(group=self.control)
        except Exception as exc:
            self.broken = f"a worker failed while loading its shard: {exc}"
            self.close()
            raise RankGroupError(self.broken) from exc
        logger.info("rank group of %d ready (%s)", self.spec.layout.world_size, self.spec.init_method)

    def forward_data_parallel(self, runner: ModelRunner, batches: list, copies: list) -> list:
        """Data-parallel attention (ParallelLayout.data_parallel): rank r runs batches[r] (a ForwardBatch, or None:
        no request there this step) over its own pools, with copies[r] (StepCopies) around it; every rank learns all
        ranks' token counts, which the MoE exchange pads to. Rank 0's part runs on `runner`.
        Returns rank r's logits for each rank r that had a batch (None for the others), gathered on rank 0."""
        counts = tuple(b.num_tokens if b is not None else 0 for b in batches)
        for batch in batches:
            if batch is not None:
                batch.dp_token_counts = counts
        payloads = [(b, c, counts) for b, c in zip(batches, copies)]

        def run():
            dist.scatter_object_list([None], payloads, src=0, group=self.control)
            own = _data_parallel_step(runner, *payloads[0])
            gathered = [None] * len(batches)  # the workers' logits come over the control group (host tensors)
            dist.gather_object(None, gathered, dst=0, group=self.control)
            gathered[0] = own
            return gathered

        return self.run(DataParallelForward(), run)

    def run(self, message, run_own):
        """Send every worker `message` (a Forward or a Draft: backend/runner.py), then run rank 0's part
        (`run_own()`, its result returned); RankGroupError if any rank is gone."""
        if self.broken:
            raise RankGroupError(self.broken)
        try:
            self._check_workers()
            dist.broadcast_object_list([message], src=0, group=self.control)
            return run_own()
        except RankGroupError:
            raise
        except Exception as exc:  # a collective failed or timed out: the group cannot step again
            self.broken = f"tensor/expert parallel group failed: {exc}"
            raise RankGroupError(self.broken) from exc

    def _check_workers(self) -> None:
        dead = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self._processes) if not p.is_alive()]
        if dead:
            self.broken = f"worker process gone: {', '.join(dead)}"
            raise RankGroupError(self.broken)

    def close(self, timeout: float = 30.0) -> None:
        """Tell the workers to exit, wait for them `timeout` seconds in all (terminate stragglers), leave the process
        group."""
        deadline = time.monotonic() + timeout
        if not self.broken:
            try:
                dist.broadcast_object_list([Stop()], src=0, group=self.control)
            except Exception:  # noqa: BLE001 (a broken group: the workers are terminated below)
                pass
        for p in self._processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()
