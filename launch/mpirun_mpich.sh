#!/usr/bin/env bash
# Run `ep-comm bench|stress|info` under MPICH (Hydra mpiexec), one rank per GPU.
#
#   launch/mpirun_mpich.sh bench --tokens 128
#   NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts launch/mpirun_mpich.sh stress
#
# ep_comm reads PMI_RANK/PMI_SIZE and MPI_LOCALRANKID (set by Hydra).  Without MASTER_ADDR, rank 0's
# address and a free port are broadcast with mpi4py (which must be built against this MPICH).
# Variables (defaults): NP (GPUS_PER_NODE), GPUS_PER_NODE (GPUs nvidia-smi lists), HOSTFILE (none),
# MPIEXEC (mpiexec), MPI_EXTRA_ARGS (none), EP_COMM_CMD, EP_COMM_BACKEND, EP_COMM_PYTHON.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/common.sh"
ep_comm_pick_command "$@"; shift "$EP_COMM_SHIFT"

GPUS_PER_NODE="${GPUS_PER_NODE:-$(ep_comm_gpus_on_this_node)}"
NP="${NP:-$GPUS_PER_NODE}"
MPIEXEC="${MPIEXEC:-mpiexec}"

args=(-n "$NP" -ppn "$GPUS_PER_NODE")
[[ -n "${HOSTFILE:-}" ]] && args+=(-f "$HOSTFILE")
# -genvlist forwards these variables to every rank
envlist="PATH,LD_LIBRARY_PATH,NCCL_NVLS_ENABLE,NVSHMEM_DISABLE_NVLS,TORCH_SYMM_MEM_DISABLE_MULTICAST"
for var in PYTHONPATH EP_COMM_BACKEND EP_COMM_HOST_ID MASTER_ADDR MASTER_PORT NVSHMEM_REMOTE_TRANSPORT NCCL_DEBUG; do
    [[ -n "${!var:-}" ]] && envlist+=",$var"
done
args+=(-genvlist "$envlist")
# shellcheck disable=SC2206
args+=(${MPI_EXTRA_ARGS:-})

set -x
exec "$MPIEXEC" "${args[@]}" "$EP_COMM_PYTHON" -m ep_comm "$EP_COMM_CMD" "$@"
