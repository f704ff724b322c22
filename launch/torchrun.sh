#!/usr/bin/env bash
# Run `ep-comm bench|stress|info` under torchrun, on one node or several.
#
#   launch/torchrun.sh bench --tokens 128 4096 --json bench.json          # one node, all its GPUs
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh stress       # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 launch/torchrun.sh stress       # on node1
#
# Variables (defaults): NNODES (1), NODE_RANK (0), GPUS_PER_NODE (GPUs nvidia-smi lists),
# MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), EP_COMM_CMD (bench, if no subcommand is given),
# EP_COMM_BACKEND (unset: auto), EP_COMM_PYTHON (python3).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
ep_comm_pick_command "$@"; shift "$EP_COMM_SHIFT"

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-$(ep_comm_gpus_on_this_node)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"

if [[ "$NNODES" -gt 1 && "$MASTER_ADDR" == "127.0.0.1" ]]; then
    echo "torchrun.sh: NNODES=$NNODES needs MASTER_ADDR set to node 0's address on every node" >&2
    exit 2
fi

set -x
exec "$EP_COMM_PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m ep_comm "$EP_COMM_CMD" "$@"
