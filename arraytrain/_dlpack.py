"""DLPack's device types (dlpack.h) as arraytrain reads them: which memory NumPy reads, which a GPU holds."""

CPU, CUDA, CUDA_HOST, CUDA_MANAGED, ROCM = 1, 2, 3, 13, 10
#: Memory NumPy reads: the CPU's and CUDA-pinned host memory.
HOST_DEVICES = (CPU, CUDA_HOST)
#: Memory a GPU holds (read through CuPy).
GPU_DEVICES = (CUDA, CUDA_MANAGED, ROCM)
