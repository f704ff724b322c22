#!/usr/bin/env bash
# Run `ep-comm bench|stress|info` under Open MPI's mpirun (one rank per GPU).
#
#   launch/mpirun_openmpi.sh bench --tokens 128                       # this node, all GPUs
#   NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts launch/mpirun_openmpi.sh stress
#
# ep_comm reads OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK.  Without MASTER_ADDR, rank 0's address and a free
# port are broadcast with mpi4py (pip install mpi4py); export MASTER_ADDR/MASTER_PORT to skip that.
# Variables (defaults): NP (GPUS_PER_NODE), GPUS_PER_NODE (GPUs nvidia-smi lists), HOSTFILE (none),
# MPIRUN (mpirun), MPI_EXTRA_ARGS (none; e.g. "--allow-run-as-root" in containers, "--mca btl ^openib"),
# EP_COMM_CMD, EP_COMM_BACKEND, EP_COMM_PYTHON.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
ep_comm_pick_command "$@"; shift "$EP_COMM_SHIFT"

GPUS_PER_NODE="${GPUS_PER_NODE:-$(ep_comm_gpus_on_this_node)}"
NP="${NP:-$GPUS_PER_NODE}"
MPIRUN="${MPIRUN:-mpirun}"

args=(-np "$NP" --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none)
[[ -n "${HOSTFILE:-}" ]] && args+=(--hostfile "$HOSTFILE")
# -x forwards variables to every rank (remote nodes do not inherit this shell's environment)
for var in PATH LD_LIBRARY_PATH PYTHONPATH NCCL_NVLS_ENABLE NVSHMEM_DISABLE_NVLS TORCH_SYMM_MEM_DISABLE_MULTICAST \
           EP_COMM_BACKEND EP_COMM_HOST_ID MASTER_ADDR MASTER_PORT NVSHMEM_REMOTE_TRANSPORT NCCL_DEBUG; do
    [[ -n "${!var:-}" ]] && args+=(-x "$var")
done
# shellcheck disable=SC2206  # MPI_EXTRA_ARGS is deliberately word-split
args+=(${MPI_EXTRA_ARGS:-})

set -x
exec "$MPIRUN" "${args[@]}" "$EP_COMM_PYTHON" -m ep_comm "$EP_COMM_CMD" "$@"
