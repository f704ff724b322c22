import os

import pytest
import torch

# Keep NVLink multicast off everywhere (shared GPU hosts; see docs/operations.md, multicast).
for _var, _val in (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ.setdefault(_var, _val)


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs (found {ngpu})")
    for item in items:
        if "gpu" in item.keywords and ngpu == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and ngpu < 2:
            item.add_marker(skip_multi)
