// LLM.int8() split matmul on tensor cores, for CuPy's RawModule (Dettmers et al. 2022, §3.2 and eq. 7).
//
// X (M, K) float32 times W (K, N), W kept quantized and transposed, W_t (N, K) int8, with one absmax per output
// feature (as the CPU tiers keep it):
//   outlier_columns   one thread per hidden dimension: flag k when some |x[m, k]| >= threshold.
//   quantize_rows     the fused vector-wise quantizer, one block per row: absmax over the regular columns (a
//                     shared-memory tree reduction), then x_i8 = rint(x · 127 / absmax), 0 in flagged columns.
//   gemm_i8_mma       C = X_i8 W_tᵀ on tensor cores, mma.sync.m16n8k32 s8 · s8 -> s32 (sm_80+), 64 × 64 tiles
//                     per block of 4 warps (2 × 2, 32 × 32 each), K in steps of 64 bytes through two cp.async
//                     shared stages; the dequantize epilogue y = C · absmax_x[m] / 127² · absmax_w[n] is fused
//                     into the store (the int32 C is also written when asked, for exactness tests).
//   gemm_i8_dp4a      the same product for parts without int8 mma (sm_61 .. sm_75): one output per thread,
//                     four int8 products per __dp4a.
//   outlier_gemm      y += X[:, O] W[O, :] over the outlier dimensions O: float16 values, float32 sums, added
//                     in the CPU tier's order; W's outlier rows come from the kept float16 copy when there is
//                     one, else from int8 (W_t[n, k] · absmax_w[n] / 127).
// Rounding is round-half-to-even (rintf), as np.rint, so the int8 operands and the int32 product equal the CPU
// tier's bit for bit. K must be a multiple of 16 here (16-byte cp.async rows); the launcher pads with zeros.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k32", .s8): groupID g = lane / 4, tig = lane % 4.
// A (16 × 32, row): a0 = row g, k = 4·tig .. 4·tig + 3; a1 = row g + 8, same k; a2 = row g, k = 16 + 4·tig ..;
// a3 = row g + 8, k = 16 + 4·tig ... B (32 × 8, col): b0 = k = 4·tig .. 4·tig + 3 of column g; b1 = k = 16 + 4·tig
// .. of column g. C (s32): c0, c1 = row g, columns 2·tig, 2·tig + 1; c2, c3 = row g + 8, same columns.
#include <cuda_fp16.h>

namespace ioaware {

constexpr float QMAX = 127.0f;  // symmetric int8 range (LLM.int8() §3.1)

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    int src_bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

__global__ void outlier_columns(const float* __restrict__ x, int M, int K, float threshold,
                                unsigned char* __restrict__ flags) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;  // neighbouring threads, neighbouring columns
    if (col >= K) return;
    unsigned char found = 0;
    for (int m = 0; m < M; ++m) found |= fabsf(x[static_cast<size_t>(m) * K + col]) >= threshold;
    flags[col] = found;
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
quantize_rows(const float* __restrict__ x, const unsigned char* __restrict__ skip, int K, int K_padded,
              signed char* __restrict__ x_i8, float* __restrict__ absmax) {
    __shared__ float red[THREADS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float* x_row = x + static_cast<size_t>(row) * K;
    // absmax over the regular columns
    float amax = 0.0f;
    for (int k = t; k < K; k += THREADS)
        if (!skip[k]) amax = fmaxf(amax, fabsf(x_row[k]));
    red[t] = amax;
    __syncthreads();  // all partial maxima written
    for (int width = THREADS / 2; width > 0; width /= 2) {
        if (t < width) red[t] = fmaxf(red[t], red[t + width]);
        __syncthreads();  // this level done before the next reads it
    }
    amax = red[0];
    // round while the row is still in L1/L2; outlier columns and the padding to K_padded become 0
    const float scale = amax > 0.0f ? QMAX / amax : 0.0f;
    signed char* q_row = x_i8 + static_cast<size_t>(row) * K_padded;
    for (int k = t; k < K_padded; k += THREADS)
        q_row[k] = (k < K && !skip[k]) ? static_cast<signed char>(__float2int_rn(x_row[k] * scale)) : 0;
    if (t == 0) absmax[row] = amax;
}

__global__ void quantize_columns_t(const float* __restrict__ w, int K, int N, int K_padded,
                                   signed char* __restrict__ w_t, float* __restrict__ absmax) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;  // one output feature per thread
    if (n >= N) return;
    float amax = 0.0f;
    for (int k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(w[static_cast<size_t>(k) * N + n]));
    const float scale = amax > 0.0f ? QMAX / amax : 0.0f;
    signed char* row = w_t + static_cast<size_t>(n) * K_padded;
    for (int k = 0; k < K_padded; ++k)
        row[k] = k < K ? static_cast<signed char>(__float2int_rn(w[static_cast<size_t>(k) * N + n] * scale)) : 0;
    absmax[n] = amax;
}

__device__ __forceinline__ void mma_16832_s8(int (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float dequantize(int c, float absmax_x, float absmax_w) {
    const float row_scale = absmax_x * (1.0f / (QMAX * QMAX));  // the CPU tier's order of float32 operations
    return static_cast<float>(c) * (row_scale * absmax_w);
}

// BM × BN outputs per block of 4 warps; BK bytes of K per shared stage; rows padded by 16 bytes (bank spread).
template <int BM, int BN, int BK>
__global__ void __launch_bounds__(128)
gemm_i8_mma(const signed char* __restrict__ a, const signed char* __restrict__ w_t, int M, int N, int K,
            const float* __restrict__ absmax_x, const float* __restrict__ absmax_w, float* __restrict__ y,
            int* __restrict__ c_out) {
    constexpr int LD = BK + 16;
    constexpr int CHUNKS = BK / 16;        // 16-byte chunks per row and stage
    constexpr int WM = BM / 2, WN = BN / 2;  // each warp's tile (2 × 2 warps)
    constexpr int MT = WM / 16, NT = WN / 8;  // mma tiles per warp
    static_assert(BK % 32 == 0 && WM % 16 == 0 && WN % 8 == 0, "whole mma shapes");
    __shared__ __align__(16) signed char a_s[2][BM * LD];
    __shared__ __align__(16) signed char w_s[2][BN * LD];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, tig = lane % 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int wm = (warp / 2) * WM, wn = (warp % 2) * WN;

    auto load = [&](int k0, int stage) {
        for (int c = tid; c < BM * CHUNKS; c += 128) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 16;
            const bool inside = m0 + r < M && k0 + col < K;
            cp_async_16(&a_s[stage][r * LD + col], inside ? a + static_cast<size_t>(m0 + r) * K + k0 + col : a,
                        inside);
        }
        for (int c = tid; c < BN * CHUNKS; c += 128) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 16;
            const bool inside = n0 + r < N && k0 + col < K;
            cp_async_16(&w_s[stage][r * LD + col],
                        inside ? w_t + static_cast<size_t>(n0 + r) * K + k0 + col : w_t, inside);
        }
    };

    int acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0;

    const int n_steps = (K + BK - 1) / BK;
    load(0, 0);
    cp_async_commit();
    for (int step = 0; step < n_steps; ++step) {
        // prefetch the next K slice into the other stage, then wait for this one
        if (step + 1 < n_steps) load((step + 1) * BK, (step + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // this stage is in shared memory for every warp
        const signed char* as = a_s[step & 1];
        const signed char* ws = w_s[step & 1];
#pragma unroll
        for (int kk = 0; kk < BK; kk += 32) {
            unsigned int af[MT][4], bf[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const signed char* p = as + (wm + mt * 16 + g) * LD + kk + 4 * tig;
                af[mt][0] = *reinterpret_cast<const unsigned int*>(p);
                af[mt][1] = *reinterpret_cast<const unsigned int*>(p + 8 * LD);
                af[mt][2] = *reinterpret_cast<const unsigned int*>(p + 16);
                af[mt][3] = *reinterpret_cast<const unsigned int*>(p + 8 * LD + 16);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const signed char* p = ws + (wn + nt * 8 + g) * LD + kk + 4 * tig;
                bf[nt][0] = *reinterpret_cast<const unsigned int*>(p);
                bf[nt][1] = *reinterpret_cast<const unsigned int*>(p + 16);
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_16832_s8(acc[mt][nt], af[mt], bf[nt]);
        }
        __syncthreads();  // every warp is done with this stage before the next prefetch overwrites it
    }

    // the dequantize epilogue, fused into the store
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + wm + mt * 16 + g + (e >= 2 ? 8 : 0);
                const int n = n0 + wn + nt * 8 + 2 * tig + (e & 1);
                if (m < M && n < N) {
                    y[static_cast<size_t>(m) * N + n] = dequantize(acc[mt][nt][e], absmax_x[m], absmax_w[n]);
                    if (c_out != nullptr) c_out[static_cast<size_t>(m) * N + n] = acc[mt][nt][e];
                }
            }
}

__global__ void gemm_i8_dp4a(const signed char* __restrict__ a, const signed char* __restrict__ w_t, int M, int N,
                             int K, const float* __restrict__ absmax_x, const float* __restrict__ absmax_w,
                             float* __restrict__ y, int* __restrict__ c_out) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y;
    if (n >= N) return;
    const int* a4 = reinterpret_cast<const int*>(a + static_cast<size_t>(m) * K);
    const int* w4 = reinterpret_cast<const int*>(w_t + static_cast<size_t>(n) * K);
    int acc = 0;
    for (int k = 0; k < K / 4; ++k) acc = __dp4a(a4[k], w4[k], acc);  // four int8 products per instruction
    y[static_cast<size_t>(m) * N + n] = dequantize(acc, absmax_x[m], absmax_w[n]);
    if (c_out != nullptr) c_out[static_cast<size_t>(m) * N + n] = acc;
}

__global__ void outlier_gemm(const float* __restrict__ x, const int* __restrict__ cols, int J, int K,
                             const signed char* __restrict__ w_t, int K_padded, const float* __restrict__ absmax_w,
                             const __half* __restrict__ w_fp16, int M, int N, float* __restrict__ y) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    const int m = blockIdx.y;
    if (n >= N) return;
    float acc = y[static_cast<size_t>(m) * N + n];  // y + x_0 w_0 + x_1 w_1 + ..., as the CPU tier sums
    for (int j = 0; j < J; ++j) {
        const int k = cols[j];
        const float xv = __half2float(__float2half_rn(x[static_cast<size_t>(m) * K + k]));
        const float wv = w_fp16 != nullptr
                             ? __half2float(w_fp16[static_cast<size_t>(k) * N + n])
                             : __half2float(__float2half_rn(static_cast<float>(w_t[static_cast<size_t>(n) * K_padded + k]) *
                                                            (absmax_w[n] / QMAX)));
        acc = __fadd_rn(acc, __fmul_rn(xv, wv));  // no fused multiply-add: the CPU tier rounds both
    }
    y[static_cast<size_t>(m) * N + n] = acc;
}

}  // namespace ioaware

#ifdef IOAWARE_INSTANTIATE_ALL  // the compile check (tests/kernels/test_cuda_compile.py) builds every variant
template __global__ void ioaware::quantize_rows<256>(const float*, const unsigned char*, int, int, signed char*,
                                                     float*);
template __global__ void ioaware::gemm_i8_mma<64, 64, 64>(const signed char*, const signed char*, int, int, int,
                                                          const float*, const float*, float*, int*);
#endif
