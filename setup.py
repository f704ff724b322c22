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

    ext = CUDAExtension(
        name="ep_comm._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
