# Shared by the launch scripts (sourced, not run).  Picks the ep-comm subcommand and sets defaults.
#
# Subcommand: the first argument if it is one of bench/stress/info, else $EP_COMM_CMD, else "bench".
# Everything after it is passed to `ep-comm <subcommand>` unchanged.

ep_comm_pick_command() {
    case "${1:-}" in
        bench|stress|info) EP_COMM_CMD="$1"; EP_COMM_SHIFT=1 ;;
        *) EP_COMM_CMD="${EP_COMM_CMD:-bench}"; EP_COMM_SHIFT=0 ;;
    esac
}

# Multicast / NVLink SHARP stays off: on shared GPU hosts (and on the machines the project is measured
# on) creating multicast objects fails or disturbs other jobs (docs/operations.md, multicast).  These are only defaults:
# a value already exported wins, e.g. `NCCL_NVLS_ENABLE=1 launch/torchrun.sh` on a dedicated node.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"

# Python that has ep_comm installed (override for a virtualenv on the compute nodes).
EP_COMM_PYTHON="${EP_COMM_PYTHON:-python3}"

ep_comm_gpus_on_this_node() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1
    else
        echo 1
    fi
}
