// The mnnvl combine kernels compiled again for ep_comm._C_nvshmem (EP_COMM_NVSHMEM: namespace
// nvshmem_kernels, put mode available; see csrc/mnnvl/mnnvl.cuh).
// torch's extension build defines these to keep half/bfloat16 operators out of its own code;
// NVSHMEM's device headers use those operators, so they are undefined before any CUDA header.
#undef __CUDA_NO_HALF_OPERATORS__
#undef __CUDA_NO_HALF_CONVERSIONS__
#undef __CUDA_NO_HALF2_OPERATORS__
#undef __CUDA_NO_BFLOAT16_CONVERSIONS__
#undef __CUDA_NO_BFLOAT162_OPERATORS__
#include "mnnvl/combine.cu"
