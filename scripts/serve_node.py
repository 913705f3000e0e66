#!/usr/bin/env python3
"""The ranks of one more node for a model served across several nodes (tensor / expert parallelism).

Node 0 runs tritonserver (rank 0 and its local ranks); every other node runs this, with the same
engine parameters and the same environment (docs/parallel.md):

    MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2 NODE_RANK=1 \\
        python scripts/serve_node.py --set checkpoint=/data/DeepSeek-V4-Flash \\
            --set tensor_parallel_size=16 --set expert_parallel_size=16

It spawns ranks NODE_RANK * P .. NODE_RANK * P + P - 1 (P = ranks / NNODES, one per local GPU), which
join rank 0's process group, load their shards and run every step rank 0 broadcasts; it exits when
rank 0 ends the group (or fails when a rank does).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backend.config import EngineConfig  # noqa: E402
from backend.rank_main import run_node  # noqa: E402
from make_model_repository import parse_sets  # noqa: E402  (scripts/ is this script's first path entry)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine parameter, as in config.pbtxt (repeat)")
    parser.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", "0")))
    args = parser.parse_args(argv)
    params = parse_sets(args.set, [f.name for f in dataclasses.fields(EngineConfig)])
    logging.basicConfig(level=logging.INFO)
    run_node(EngineConfig.from_parameters(params), args.node_rank)


if __name__ == "__main__":
    main()
