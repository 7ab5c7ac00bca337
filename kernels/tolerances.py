"""How close a kernel must come to its float64 oracle: one table for every kernel (attention, LLM.int8()'s float
results, SnapKV's scores), used by the tests and the GPU check alike, by dtype name.

Full precision: |x − ref| <= atol · scale + rtol · |ref| on the same rounded inputs, where ``scale`` is the size of
what was summed (1 for attention, whose outputs are convex combinations of the values; max |ref| for a matmul,
whose terms cancel). float16 and bfloat16 by flash-attn's rule instead: error <= LOW_PRECISION_FACTOR × the error
of the same computation done plainly in that precision, plus UNIT_ROUNDOFF (half an ulp, relative: 2^-11 for IEEE
binary16, 2^-8 for bfloat16) of the output's scale. Integer results (int8 operands, int32 products, kept
positions) are compared exactly, never through this table.
"""
TOLERANCES = {"float64": {"atol": 1e-12, "rtol": 1e-10}, "float32": {"atol": 3e-6, "rtol": 1e-5}}
LOW_PRECISION_FACTOR = 2.0
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
