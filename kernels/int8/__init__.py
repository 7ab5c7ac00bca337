"""LLM.int8() (Dettmers et al. 2022): vector-wise int8 quantization, the outlier-decomposed int8 matmul, a naive
per-tensor baseline and an ``Int8Linear`` layer, on NumPy arrays (Numba kernels), with float64/int64 oracles."""
from ._api import (Int8Linear, Int8Weight, int8_gemm, int8_matmul, naive_absmax_matmul, quantize_vectorwise)
from ._numba_cpu import MAX_EXACT_K, QMAX
from ._reference import int8_matmul_reference, naive_absmax_reference, quantize_reference

__all__ = ["Int8Linear", "Int8Weight", "MAX_EXACT_K", "QMAX", "int8_gemm", "int8_matmul", "int8_matmul_reference",
           "naive_absmax_matmul", "naive_absmax_reference", "quantize_reference", "quantize_vectorwise"]
