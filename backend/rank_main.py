"""What a worker rank's process runs (ranks 1..N-1, spawned by rank 0 or by scripts/serve_node.py on another node).

    RankGroup.start(config, layout, worker_main)   # rank 0 (backend/engine.py)
    run_node(config, node_rank)                    # every other node (scripts/serve_node.py)

A worker joins the group, plans the same deployment as rank 0 and loads its shard (backend/deployment.py), reports
ready, then serves until rank 0 ends it: under tensor/expert parallelism it follows rank 0's steps (`_follow`: every
`Forward`, `Draft` and `DraftChain` rank 0 broadcasts, run on its own ModelRunner); under data parallelism it is a
whole engine of its own (`_serve`: backend/engine_core.py over its own pools, backend/parallel/data_parallel.py's loop).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal

import torch
import torch.distributed as dist
from torch.multiprocessing import _prctl_pr_set_pdeathsig

from backend.config import EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.engine_core import EngineCore, grammar_service
from backend.host_memory import freeze_start_up_heap
from backend.model.comm import RankGroupError
from backend.parallel.data_parallel import RankLink, serve_rank
from backend.parallel.group import GroupSpec, join, ranks_per_node, ready, spawn_ranks
from backend.model.parallel_layout import ParallelLayout
from backend.parallel.messages import Stop
from backend.runner import Draft, DraftChain, Forward, ModelRunner, make_runner
from backend.stack_dump import dump_stacks_on_sigusr1


def worker_main(index: int, spec: GroupSpec, first_rank: int) -> None:
    """A worker rank (process `index` of its node is rank first_rank + index): join, load the shard, then serve. What
    ends it by an exception is logged on its standard error first (rank 0 sees only that the process is gone)."""
    rank = first_rank + index
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    dump_stacks_on_sigusr1()
    _outlive_a_ctrl_c()
    try:
        _serve_worker(rank, spec)
    except Exception:
        logging.getLogger(__name__).exception("rank %d ends by an exception", rank)
        raise


def _outlive_a_ctrl_c() -> None:
    """A Ctrl-C in the server's terminal reaches every process of its group, this one too, while tritonserver stops
    gracefully: it waits for the requests running (their grace, `stop_grace_s`), which need every rank. So a worker
    ignores SIGINT, and it ends with rank 0 (the `Stop` it sends, its connection gone) or with its parent: by SIGKILL,
    where torch's spawn made that SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _prctl_pr_set_pdeathsig(signal.SIGKILL)
    if os.getppid() != multiprocessing.parent_process().pid:  # (it went before the new signal was set: reparented)
        os._exit(1)


def _serve_worker(rank: int, spec: GroupSpec) -> None:
    torch.set_num_threads(max(1, (spec.config.cpu_threads or torch.get_num_threads()) // spec.layout.world_size))
    comm, control, sync = join(spec, rank)
    if sync.lock_step:  # (a step that fails on this rank breaks the group)
        sync.end_group = lambda: _leave_the_group(rank)
    layout = ParallelLayout.from_config(spec.config, rank)
    device = spec.device(rank)
    config, dtype = spec.config, spec.config.resolved_dtype()
    deployment = plan_deployment(config, device, dtype)  # the same pools as rank 0
    model = load_model(config, deployment, device, dtype, layout, comm)
    runner = make_runner(config, model, deployment.kv, sync=sync)
    link = RankLink() if layout.data_parallel else None
    inboxes = [inbox for inbox, _ in ready(control, link.address if link else None, config)]  # (rank 0 compares)
    if link is not None:
        link.connect(inboxes[0])
        _serve(config, rank, runner, link)
    else:
        freeze_start_up_heap()  # (this process serves until it exits: backend/host_memory.py)
        _follow(runner, control)
    dist.destroy_process_group()


def _follow(runner: ModelRunner, control) -> None:
    """A tensor/expert-parallel worker: run every message rank 0 broadcasts (`Forward`, `Draft`, `DraftChain`) on its
    own ModelRunner, as rank 0 runs it, until `Stop`."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        match message[0]:
            case Forward() as step:
                runner.forward(step)
            case Draft() as step:
                runner.draft(step)
            case DraftChain() as chain:
                runner.draft_chain(chain)
            case Stop():
                return


def _serve(config: EngineConfig, rank: int, runner: ModelRunner, link: RankLink) -> None:
    """A data-parallel rank: its own engine over its own pools, serving what rank 0 places on it."""
    grammars = grammar_service(config, runner.model.config)
    core = EngineCore(config, runner.kv, runner, runner.model.kernels, grammars, send=None, rank=rank,
                      sync=runner.sync)
    freeze_start_up_heap()  # (this process serves until it exits: backend/host_memory.py)
    try:
        serve_rank(core, link)
    finally:
        core.close(timeout=10.0)
        grammars.close()
        link.close()


def _leave_the_group(rank: int) -> None:
    """A step failed on this rank in lock-step (backend/parallel/sync.py, `step_failed`): the process exits now, which
    fails the collectives the other ranks wait in at once, and rank 0 sees the rank gone and fails what is left."""
    logging.getLogger(__name__).error("rank %d leaves its group: a step failed on it in lock-step", rank)
    os._exit(1)


def run_node(config: EngineConfig, node_rank: int) -> None:
    """Another node's ranks (scripts/serve_node.py): spawn them, wait until rank 0 ends the group."""
    layout = ParallelLayout.from_config(config)
    per_node = ranks_per_node(layout.world_size)
    if not os.environ.get("MASTER_ADDR") or not 0 < node_rank < layout.world_size // per_node:
        raise RankGroupError("a worker node needs MASTER_ADDR / MASTER_PORT and 0 < NODE_RANK < NNODES")
    spec = GroupSpec(config, layout, config.collective_timeout_s)  # (env://: a node of several)
    context = spawn_ranks(spec, first_rank=node_rank * per_node, count=per_node, main=worker_main)
    while not context.join():  # raises if a rank fails; True once all exited
        pass
