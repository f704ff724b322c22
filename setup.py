"""Builds the CUDA extensions from csrc/ only where they can be built.

ep_comm._C: the one-sided kernels over mapped buffers (csrc/one_sided/, backend mnnvl), the collective
backends' kernels (csrc/collective/) and their registration (csrc/ops.cpp).  EP_COMM_BUILD_CUDA=1
forces the build (and fails loudly if it cannot), =0 skips it; unset means "build if this torch has
CUDA and nvcc is found".
ep_comm._C_nvshmem: the same one-sided kernels compiled again with EP_COMM_NVSHMEM (NVSHMEM's device
library, put mode, -rdc) and the NVSHMEM host runtime (csrc/nvshmem/); built alongside _C where the
NVSHMEM wheel (nvidia-nvshmem-cu12/13, the extra `nvshmem`) or $NVSHMEM_DIR is found;
EP_COMM_BUILD_NVSHMEM=0|1 forces it off/on.
Before compiling, csrc/common/protocol_table.h is written from ep_comm/backends/protocol.py,
the one table of what the kernels and Python share.  Everything else lives in pyproject.toml.
"""
import glob
import importlib.util
import os
import shutil

from setuptools import setup

PROTOCOL_TABLE = os.path.join("ep_comm", "backends", "protocol.py")
PROTOCOL_HEADER = os.path.join("csrc", "common", "protocol_table.h")
ONE_SIDED_KERNELS = sorted(glob.glob(os.path.join("csrc", "one_sided", "*.cu")))
# torch builds CUDA sources with these defined, to keep half/bfloat16 operators out of its own code;
# NVSHMEM's device headers use those operators
_TORCH_HALF_MACROS = ("__CUDA_NO_HALF_OPERATORS__", "__CUDA_NO_HALF_CONVERSIONS__", "__CUDA_NO_HALF2_OPERATORS__",
                      "__CUDA_NO_BFLOAT16_CONVERSIONS__", "__CUDA_NO_BFLOAT162_OPERATORS__")


#: pip's default build isolation builds in a fresh environment without the torch installed beside it
NO_TORCH_HERE = ("torch cannot be imported where this package is being built: pip builds in an isolated "
                 "environment unless told otherwise; on a GPU node install with "
                 "`pip install --no-build-isolation -e .` so the kernels are built against the installed torch")


def _want_cuda() -> bool:
    flag = os.environ.get("EP_COMM_BUILD_CUDA")
    if flag == "0":
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError as exc:
        if flag == "1":
            raise RuntimeError(f"EP_COMM_BUILD_CUDA=1: {NO_TORCH_HERE}") from exc
        return False
    if flag == "1":
        return True
    return bool(torch.version.cuda) and (CUDA_HOME is not None or shutil.which("nvcc") is not None)


def _nvshmem_dir():
    """The NVSHMEM install to build against (include/, lib/libnvshmem_host.so.3), or None."""
    flag = os.environ.get("EP_COMM_BUILD_NVSHMEM")
    if flag == "0":
        return None
    found = os.environ.get("NVSHMEM_DIR")
    if not found:
        try:
            spec = importlib.util.find_spec("nvidia.nvshmem")
        except ImportError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            found = list(spec.submodule_search_locations)[0]
    if found and os.path.exists(os.path.join(found, "lib", "libnvshmem_host.so.3")):
        return found
    if flag == "1":
        raise RuntimeError(f"EP_COMM_BUILD_NVSHMEM=1 but no NVSHMEM with lib/libnvshmem_host.so.3 was found "
                           f"(NVSHMEM_DIR={os.environ.get('NVSHMEM_DIR')!r}; pip install nvidia-nvshmem-cu13)")
    return None


def _nvshmem_extension(nvshmem: str):
    """ep_comm._C_nvshmem: the NVSHMEM runtime and the kernels built again with put mode (-rdc, linked
    against libnvshmem_device.a; the ``nvcc_dlink`` entry makes torch add the device-link step)."""
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    cuda_inc = os.path.join(CUDA_HOME or "/usr/local/cuda", "include")
    lib = os.path.join(nvshmem, "lib")
    return CUDAExtension(
        name="ep_comm._C_nvshmem",
        sources=sorted(glob.glob("csrc/nvshmem/*.cpp")) + ONE_SIDED_KERNELS,
        # CUDA 13's headers that NVSHMEM's include need cuda/std/* from cccl (host compiler)
        include_dirs=[os.path.abspath("csrc"), os.path.join(nvshmem, "include"), os.path.join(cuda_inc, "cccl")],
        library_dirs=[lib],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", "-DEP_COMM_NVSHMEM"],
            "nvcc": ["-O3", "-lineinfo", "-std=c++17", "-rdc=true", "-DEP_COMM_NVSHMEM",
                     *(f"-U{m}" for m in _TORCH_HALF_MACROS)],
            "nvcc_dlink": ["-dlink", f"-L{lib}", "-lnvshmem_device"],
        },
        # the wheel ships only the versioned soname: link that file, the one torch already loads
        extra_link_args=["-l:libnvshmem_host.so.3", "-l:libnvshmem_device.a", f"-Wl,-rpath,{lib}"],
    )


def _write_protocol_header() -> None:
    """csrc/common/protocol_table.h from the protocol table (rewritten only when it changes)."""
    spec = importlib.util.spec_from_file_location("_ep_comm_protocol", PROTOCOL_TABLE)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    text = table.cpp_header()
    if os.path.exists(PROTOCOL_HEADER):
        with open(PROTOCOL_HEADER) as f:
            if f.read() == text:
                return
    with open(PROTOCOL_HEADER, "w") as f:
        f.write(text)


def _build_ext_class(base):
    """``base`` (torch's BuildExtension) with one temporary folder per extension: both compile
    csrc/one_sided/*.cu, with other flags, so their object files must not share paths."""

    class BuildExtensionPerFolder(base):
        def build_extension(self, ext):
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared

    return BuildExtensionPerFolder


def _extensions():
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/collective/*.cu")) + ONE_SIDED_KERNELS
    if not ONE_SIDED_KERNELS or not _want_cuda():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    _write_protocol_header()
    _default_arch_list()
    ext = CUDAExtension(
        name="ep_comm._C",
        sources=sources,
        include_dirs=[os.path.abspath("csrc")],
        # no --use_fast_math: the fused fp8 quantisation must match ep_comm.quant bit for bit
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-lineinfo", "-std=c++17"]},
    )
    exts = [ext]
    nvshmem = _nvshmem_dir()
    if nvshmem:
        exts.append(_nvshmem_extension(nvshmem))
    build = _build_ext_class(BuildExtension).with_options(use_ninja=shutil.which("ninja") is not None)
    return exts, {"build_ext": build}


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
