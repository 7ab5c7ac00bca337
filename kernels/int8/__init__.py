"""LLM.int8() (Dettmers et al. 2022): vector-wise int8 quantization, the outlier-decomposed int8 matmul, a naive
per-tensor baseline and an ``Int8Linear`` layer, with float64/int64 oracles. Weights are (out_features,
in_features), as ``torch.nn.Linear`` stores them; the matmul runs on the CPU (Numba) and on the GPU (Numba-CUDA,
and CUDA C with int8 tensor cores through CuPy)."""
from ._api import (Int8Linear, Int8Weight, int8_gemm, int8_matmul, naive_absmax_matmul, product_path,
                   quantize_vectorwise)
from ._numba_cpu import MAX_EXACT_K, QMAX
from ._reference import int8_matmul_reference, naive_absmax_reference, quantize_reference

__all__ = ["Int8Linear", "Int8Weight", "MAX_EXACT_K", "QMAX", "int8_gemm", "int8_matmul", "int8_matmul_reference",
           "naive_absmax_matmul", "naive_absmax_reference", "product_path", "quantize_reference", "quantize_vectorwise"]
