"""The ranks of one model instance: rank 0 and its worker processes (group.py), each building its shard through
backend/deployment.py. How the model is split over the ranks and the collectives its forward calls are the model's
(backend/model/parallel_layout.py, backend/model/comm.py), so the model never imports this package."""

import os


def node_count() -> int:
    """The nodes the ranks span: NNODES in the environment (1 when unset). Several meet through env:// (MASTER_ADDR,
    MASTER_PORT); one meets at rank 0's own store on loopback whatever else the environment holds (a MASTER_ADDR that
    a cluster's pod or job sets for its own use is not ours)."""
    return int(os.environ.get("NNODES", "1"))
