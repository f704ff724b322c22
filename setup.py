"""Builds the CUDA extension from csrc/ only where it can be built.

EP_COMM_BUILD_CUDA=1 forces the build (and fails loudly if it cannot), =0 skips it; unset means
"build if this torch has CUDA and nvcc is found".  Everything else lives in pyproject.toml.
"""
import glob
import os
import shutil

from setuptools import setup


def _want_cuda() -> bool:
    flag = os.environ.get("EP_COMM_BUILD_CUDA")
    if flag is not None:
        return flag == "1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False
    return bool(torch.version.cuda) and (CUDA_HOME is not None or shutil.which("nvcc") is not None)


def _extensions():
    sources = sorted(glob.glob("csrc/**/*.cu", recursive=True) + glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources or not _want_cuda():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _default_arch_list()
    ext = CUDAExtension(
        name="ep_comm._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        # no --use_fast_math: the fused fp8 quantisation must match ep_comm.quant bit for bit
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-lineinfo", "-std=c++17"]},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


def _default_arch_list() -> None:
    """Without TORCH_CUDA_ARCH_LIST torch builds for the GPUs it sees; with none visible (a build
    host), build Hopper, plus Blackwell where this nvcc knows it, instead of every architecture."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return
    import torch

    if torch.cuda.is_available():
        return
    major, minor = (int(v) for v in torch.version.cuda.split(".")[:2])
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0;10.0" if (major, minor) >= (12, 8) else "9.0"


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
