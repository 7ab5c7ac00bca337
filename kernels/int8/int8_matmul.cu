// LLM.int8() split matmul on tensor cores, for CuPy's RawModule (Dettmers et al. 2022, §3.2 and eq. 7).
//
// X (M, K) float32 times Wᵀ, W (N, K) = (out, in) as torch's F.linear takes it, kept quantized as W_t (N, K)
// int8 (the row quantizer below, one absmax per output feature, as the CPU tiers keep it):
//   outlier_columns   a 2-D grid, one thread per (hidden dimension, chunk of ROWS_PER_BLOCK rows): flag k when
//                     some |x[m, k]| >= threshold (flags start at 0; every writer writes 1).
//   quantize_rows     the fused vector-wise quantizer, one block per row: absmax over the regular columns (a
//                     shared-memory tree reduction), then x_i8 = rint(x · 127 / absmax), 0 in flagged columns.
//   gemm_i8_mma       C = X_i8 W_tᵀ on tensor cores, mma.sync.m16n8k32 s8 · s8 -> s32 (sm_80+), BM × BN tiles
//                     per block of 8 warps (2 × 4), K in steps of BK bytes through STAGES cp.async shared stages
//                     (dynamic shared memory), fragments by ldmatrix (an 8 × 16-byte matrix per lane group is the
//                     s8 A and B layout below); grid (M tiles, N tiles). The dequantize epilogue
//                     y = C · absmax_x[m] / 127² · absmax_w[n] is fused into the store (the int32 C is also
//                     written when asked, for exactness tests).
//   gemm_i8_dp4a      the same product for parts without int8 mma (sm_61 .. sm_75): one output per thread,
//                     four int8 products per __dp4a.
//   gather_outlier_rows  W's outlier rows once, as a dense (J, N) float16 array: from the kept float16 copy when
//                     there is one, else dequantized from int8 (W_t[n, k] · absmax_w[n] / 127).
//   outlier_gemm      y += X[:, O] W[O, :] over the outlier dimensions O: float16 values, float32 sums, added
//                     in the CPU tier's order, the (J, N) rows read coalesced; grid (M, N blocks).
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

// grid (K / blockDim.x, M / rows_per_block): neighbouring threads read neighbouring columns of one row
__global__ void outlier_columns(const float* __restrict__ x, int M, int K, int rows_per_block, float threshold,
                                unsigned char* __restrict__ flags) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= K) return;
    const int m0 = blockIdx.y * rows_per_block, m1 = min(M, m0 + rows_per_block);
    bool found = false;
    for (int m = m0; m < m1 && !found; ++m) found = fabsf(x[static_cast<size_t>(m) * K + col]) >= threshold;
    if (found) flags[col] = 1;  // every block that finds one writes the same 1; the launcher zeroed the flags
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

// ldmatrix.x4 on bytes: lanes 8i .. 8i + 7 give the addresses of matrix i's 8 rows of 16 bytes; lane l receives
// the 4 bytes (row l / 4, bytes 4·(l % 4) .. +3) of each (PTX ISA, "ldmatrix": .b16 elements, two per word)
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const signed char* row) {
    const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

// BM × BN outputs per block of 8 warps (2 × 4); BK bytes of K per shared stage, STAGES stages; rows padded by
// 16 bytes so that the 8 rows of an ldmatrix fall in distinct banks
template <int BM, int BN, int BK, int STAGES>
__global__ void __launch_bounds__(256)
gemm_i8_mma(const signed char* __restrict__ a, const signed char* __restrict__ w_t, int M, int N, int K,
            const float* __restrict__ absmax_x, const float* __restrict__ absmax_w, float* __restrict__ y,
            int* __restrict__ c_out) {
    constexpr int THREADS = 256;
    constexpr int LD = BK + 16;
    constexpr int CHUNKS = BK / 16;          // 16-byte chunks per row and stage
    constexpr int WM = BM / 2, WN = BN / 4;  // each warp's tile (2 × 4 warps)
    constexpr int MT = WM / 16, NT = WN / 8;  // mma tiles per warp
    static_assert(BK % 32 == 0 && WM % 16 == 0 && WN % 16 == 0 && STAGES >= 2, "whole mma shapes, paired n-tiles");
    extern __shared__ __align__(16) signed char smem[];
    signed char* a_s = smem;                        // (STAGES, BM, LD)
    signed char* w_s = smem + STAGES * BM * LD;     // (STAGES, BN, LD)

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, tig = lane % 4;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;  // M tiles on x: its limit is 2^31 − 1
    const int wm = (warp / 4) * WM, wn = (warp % 4) * WN;

    auto load = [&](int k0, int stage) {
        for (int c = tid; c < BM * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 16;
            const bool inside = m0 + r < M && k0 + col < K;
            cp_async_16(a_s + (stage * BM + r) * LD + col,
                        inside ? a + static_cast<size_t>(m0 + r) * K + k0 + col : a, inside);
        }
        for (int c = tid; c < BN * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 16;
            const bool inside = n0 + r < N && k0 + col < K;
            cp_async_16(w_s + (stage * BN + r) * LD + col,
                        inside ? w_t + static_cast<size_t>(n0 + r) * K + k0 + col : w_t, inside);
        }
    };

    int acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0;

    // the pipeline: STAGES − 1 slices in flight before the first product; one group committed per slice
    const int n_steps = (K + BK - 1) / BK;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_steps) load(st * BK, st);
        cp_async_commit();
    }
    const int mat = lane / 8, mat_row = lane % 8;  // the ldmatrix matrix this lane addresses, and its row there
    for (int step = 0; step < n_steps; ++step) {
        cp_async_wait<STAGES - 2>();  // slice `step` has landed (the later ones may still be in flight)
        __syncthreads();  // ... for every thread's copies; and every warp is done with the stage refilled below
        const int next = step + STAGES - 1;
        if (next < n_steps) load(next * BK, next % STAGES);
        cp_async_commit();
        const signed char* as = a_s + (step % STAGES) * BM * LD;
        const signed char* ws = w_s + (step % STAGES) * BN * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 32) {
            // A: lane l points at row l % 16 of the 16-row tile, bytes kk + (l / 16) · 16: matrices 0..3 are
            // a0 .. a3. B: lane l points at n-row (l / 16) · 8 + l % 8 of two 8-row tiles, bytes kk + (l / 8 % 2)
            // · 16: matrices 0, 1 are b0, b1 of tile nt and 2, 3 of tile nt + 1
            unsigned int af[MT][4], bf[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldmatrix_x4(af[mt], as + (wm + mt * 16 + lane % 16) * LD + kk + (lane / 16) * 16);
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                unsigned int r[4];
                ldmatrix_x4(r, ws + (wn + nt * 8 + (mat / 2) * 8 + mat_row) * LD + kk + (mat % 2) * 16);
                bf[nt][0] = r[0];
                bf[nt][1] = r[1];
                bf[nt + 1][0] = r[2];
                bf[nt + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_16832_s8(acc[mt][nt], af[mt], bf[nt]);
        }
    }
    cp_async_wait<0>();  // no copy outlives the block (the last groups are empty)

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
    const int m = blockIdx.x;  // rows on x: its limit is 2^31 − 1
    const int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int* a4 = reinterpret_cast<const int*>(a + static_cast<size_t>(m) * K);
    const int* w4 = reinterpret_cast<const int*>(w_t + static_cast<size_t>(n) * K);
    int acc = 0;
    for (int k = 0; k < K / 4; ++k) acc = __dp4a(a4[k], w4[k], acc);  // four int8 products per instruction
    y[static_cast<size_t>(m) * N + n] = dequantize(acc, absmax_x[m], absmax_w[n]);
    if (c_out != nullptr) c_out[static_cast<size_t>(m) * N + n] = acc;
}

__global__ void gather_outlier_rows(const int* __restrict__ cols, int J, const signed char* __restrict__ w_t,
                                    int K_padded, const float* __restrict__ absmax_w,
                                    const __half* __restrict__ w_fp16, int N, __half* __restrict__ w_o) {
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over (J, N)
    if (idx >= static_cast<size_t>(J) * N) return;
    const int j = static_cast<int>(idx / N), n = static_cast<int>(idx % N);
    const int k = cols[j];
    w_o[idx] = w_fp16 != nullptr ? w_fp16[static_cast<size_t>(k) * N + n]
                                 : __float2half_rn(static_cast<float>(w_t[static_cast<size_t>(n) * K_padded + k]) *
                                                   (absmax_w[n] / QMAX));
}

__global__ void outlier_gemm(const float* __restrict__ x, const int* __restrict__ cols, int J, int K,
                             const __half* __restrict__ w_o, int M, int N, float* __restrict__ y) {
    const int m = blockIdx.x;  // rows on x: its limit is 2^31 − 1
    const int n = blockIdx.y * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float* x_row = x + static_cast<size_t>(m) * K;
    float acc = y[static_cast<size_t>(m) * N + n];  // y + x_0 w_0 + x_1 w_1 + ..., as the CPU tier sums
    for (int j = 0; j < J; ++j) {
        const float xv = __half2float(__float2half_rn(x_row[cols[j]]));  // one address for the whole block
        const float wv = __half2float(w_o[static_cast<size_t>(j) * N + n]);  // neighbouring n: coalesced
        acc = __fadd_rn(acc, __fmul_rn(xv, wv));  // no fused multiply-add: the CPU tier rounds both
    }
    y[static_cast<size_t>(m) * N + n] = acc;
}

}  // namespace ioaware

#ifdef IOAWARE_INSTANTIATE_ALL  // the compile check (tests/kernels/test_cuda_compile.py) builds every variant
template __global__ void ioaware::quantize_rows<256>(const float*, const unsigned char*, int, int, signed char*,
                                                     float*);
template __global__ void ioaware::gemm_i8_mma<128, 128, 64, 3>(const signed char*, const signed char*, int, int, int,
                                                               const float*, const float*, float*, int*);
#endif
