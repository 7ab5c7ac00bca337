// FlashAttention-2 forward on tensor cores, and the standard algorithm's softmax, for CuPy's RawModule.
//
// flash_forward: Dao, "FlashAttention-2" (2023), Algorithm 1. One block of BR / 16 warps per (batch · query
// head, query tile of BR rows); warp w owns rows 16w .. 16w + 15 of the tile. Q is loaded once into shared
// memory and then into registers as mma.sync A fragments; K and V tiles of BC keys stream through two shared
// stages with cp.async, so the next tile is in flight while the tensor cores work on the current one.
// S = Q Kᵀ and O += P V are mma.sync.m16n8k16 (float16 or bfloat16 in, float32 accumulate, PTX ISA §9.7.14),
// with P handed from the S accumulators to the A operand of the second product in registers (FlashAttention-2
// §3.1: no shared-memory round trip for P). The softmax runs in the log2 domain: s' = s · scale · log2(e),
// p = 2^(s' − m'), lse = (m' + log2 l) · ln 2. Causal: the mask is aligned bottom-right (row i sees keys
// j <= i + Nk − Nq) and the key loop stops at the last key the tile's last row can see. A row that sees no key
// writes zeros and lse = −inf. GQA: query head h reads kv head h / (Hq / Hkv).
//
// softmax_rows: the standard algorithm's middle kernel (S and P in global memory): one block per row of S,
// P = softmax(scale · S + mask) written over S, float32 inside, lse beside it.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"): groupID = lane / 4,
// tig = lane % 4. A (16 × 16): a0 = (row g, cols 2·tig, 2·tig + 1), a1 = (row g + 8, same cols),
// a2 = (row g, cols 8 + 2·tig, +1), a3 = (row g + 8, cols 8 + 2·tig, +1). B (16 × 8): b0 = (rows 2·tig, 2·tig + 1,
// col g), b1 = (rows 8 + 2·tig, +1, col g). C (16 × 8, float32): c0, c1 = (row g, cols 2·tig, 2·tig + 1),
// c2, c3 = (row g + 8, same cols).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace ioaware {

constexpr float LN2 = 0.6931471805599453f;  // ln 2

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }  // −inf without <cmath>

// two 16-bit values (lo in the low half) in one 32-bit register, as mma.sync takes its operands
__device__ __forceinline__ unsigned int pack2(unsigned short lo, unsigned short hi) {
    return static_cast<unsigned int>(lo) | (static_cast<unsigned int>(hi) << 16);
}

template <typename T> struct Bits;
template <> struct Bits<__half> {
    static __device__ __forceinline__ unsigned int from_floats(float lo, float hi) {
        return pack2(__half_as_ushort(__float2half_rn(lo)), __half_as_ushort(__float2half_rn(hi)));
    }
};
template <> struct Bits<__nv_bfloat16> {
    static __device__ __forceinline__ unsigned int from_floats(float lo, float hi) {
        return pack2(__bfloat16_as_ushort(__float2bfloat16_rn(lo)), __bfloat16_as_ushort(__float2bfloat16_rn(hi)));
    }
};

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// d += a · b for one 16 × 8 × 16 tile, float32 accumulators
template <typename T> __device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned int (&a)[4],
                                                                const unsigned int (&b)[2]);
template <> __device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned int (&a)[4],
                                                              const unsigned int (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned int (&a)[4],
                                                                     const unsigned int (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// cp.async of 16 bytes global -> shared; src_bytes = 0 fills the 16 bytes with zeros (rows past N)
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

__device__ __forceinline__ unsigned int load32(const unsigned short* p) {
    return *reinterpret_cast<const unsigned int*>(p);  // two neighbouring 16-bit values (4-byte aligned)
}

// Shared memory, in 16-bit elements: Q (BR rows), then K and V, two stages of BC rows each; every row padded by
// PAD elements (16 bytes) so that the 8 rows a fragment load touches fall in different banks.
template <int D> struct Rows {
    static constexpr int PAD = 8;
    static constexpr int LD = D + PAD;
    static constexpr int CHUNKS = D / 8;  // 16-byte cp.async chunks per row
};

template <typename T, int D, int BR, int BC>
__global__ void __launch_bounds__(BR / 16 * 32)
flash_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
              float* __restrict__ lse, int Hq, int Hkv, int Nq, int Nk, float scale_log2, int causal) {
    constexpr int THREADS = BR / 16 * 32;
    constexpr int LD = Rows<D>::LD;
    constexpr int CHUNKS = Rows<D>::CHUNKS;
    static_assert(D % 16 == 0 && BC % 16 == 0 && BR % 16 == 0, "tiles are whole mma shapes");
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* q_s = reinterpret_cast<unsigned short*>(smem);  // (BR, LD)
    unsigned short* k_s = q_s + BR * LD;                              // (2, BC, LD)
    unsigned short* v_s = k_s + 2 * BC * LD;                          // (2, BC, LD)

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;    // groupID: the row (and B column) this lane's fragments start at
    const int tig = lane % 4;  // thread in group: the column pair
    const int m0 = blockIdx.x * BR;
    const int bh = blockIdx.y;
    const int b = bh / Hq;
    const int h = bh % Hq;
    const int hk = h / (Hq / Hkv);
    const int offset = Nk - Nq;  // causal, bottom-right: row i sees keys j <= i + offset
    const T* q_bh = q + static_cast<size_t>(bh) * Nq * D;
    const T* k_bh = k + static_cast<size_t>(b * Hkv + hk) * Nk * D;
    const T* v_bh = v + static_cast<size_t>(b * Hkv + hk) * Nk * D;

    // load the Q tile (one cp.async group)
    for (int c = tid; c < BR * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        const bool inside = m0 + r < Nq;
        cp_async_16(q_s + r * LD + col, inside ? q_bh + static_cast<size_t>(m0 + r) * D + col : q_bh, inside);
    }
    cp_async_commit();

    // the keys this tile needs: all, or (causal) up to the last one its last row sees — later tiles are skipped
    const int k_end = causal ? min(Nk, max(0, min(m0 + BR, Nq) + offset)) : Nk;
    const int Tc = (k_end + BC - 1) / BC;
    auto load_kv = [&](int tile, int stage) {
        unsigned short* ks = k_s + stage * BC * LD;
        unsigned short* vs = v_s + stage * BC * LD;
        for (int c = tid; c < BC * CHUNKS; c += THREADS) {
            const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
            const int key = tile * BC + r;
            const bool inside = key < Nk;
            const size_t at = static_cast<size_t>(inside ? key : 0) * D + col;
            cp_async_16(ks + r * LD + col, k_bh + at, inside);
            cp_async_16(vs + r * LD + col, v_bh + at, inside);
        }
    };
    if (Tc > 0) load_kv(0, 0);
    cp_async_commit();
    cp_async_wait<1>();  // the Q group has landed (the first K/V group may still be in flight)
    __syncthreads();     // every thread's part of Q is in shared memory before anyone reads fragments

    // Q as A fragments, kept in registers for the whole key loop: (D / 16 k-steps, 4 registers)
    const int r_lo = warp * 16 + g;
    const int r_hi = r_lo + 8;
    unsigned int qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        qf[kk][0] = load32(q_s + r_lo * LD + kk * 16 + 2 * tig);
        qf[kk][1] = load32(q_s + r_hi * LD + kk * 16 + 2 * tig);
        qf[kk][2] = load32(q_s + r_lo * LD + kk * 16 + 8 + 2 * tig);
        qf[kk][3] = load32(q_s + r_hi * LD + kk * 16 + 8 + 2 * tig);
    }

    const int row_lo = m0 + r_lo;
    const int row_hi = m0 + r_hi;
    float acc_o[D / 8][4];  // this warp's 16 × D output, unnormalized (Σ_j 2^(s'_j − m') v_j)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) acc_o[dt][0] = acc_o[dt][1] = acc_o[dt][2] = acc_o[dt][3] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf();  // running max m' of rows r_lo and r_hi (log2 domain)
    float l_lo = 0.0f, l_hi = 0.0f;        // this lane's part of the running sums l (summed over tig at the end)

    for (int j = 0; j < Tc; ++j) {
        // prefetch tile j + 1 into the other stage, then wait for tile j (an empty group keeps the count right)
        if (j + 1 < Tc) load_kv(j + 1, (j + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // tile j is in shared memory for every warp
        const unsigned short* ks = k_s + (j & 1) * BC * LD;
        const unsigned short* vs = v_s + (j & 1) * BC * LD;

        // S = Q Kᵀ for this warp's 16 rows and the tile's BC keys: B[k = d][n = key] = K[key][d]
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const unsigned short* kp = ks + (nt * 8 + g) * LD + kk * 16 + 2 * tig;
                const unsigned int bf[2] = {load32(kp), load32(kp + 8)};
                mma_16816<T>(s[nt], qf[kk], bf);
            }
        }

        // scale into the log2 domain, mask (causal, keys past Nk), and the tile's row maxima
        float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j * BC + nt * 8 + 2 * tig + (e & 1);
                const int row = e < 2 ? row_lo : row_hi;
                const bool visible = key < Nk && (!causal || key <= row + offset);
                s[nt][e] = visible ? s[nt][e] * scale_log2 : neg_inf();
            }
            mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
            mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
        }
        // the 4 lanes of a group hold one row between them
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));

        // new max; a row that has seen no key yet keeps −inf and subtracts 0, so 2^(−inf) = 0 and no NaN appears
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        const float base_lo = mn_lo == neg_inf() ? 0.0f : mn_lo;
        const float base_hi = mn_hi == neg_inf() ? 0.0f : mn_hi;
        // rescale what was summed under the old max by 2^(m_old − m_new)
        const float alpha_lo = exp2f(m_lo - base_lo), alpha_hi = exp2f(m_hi - base_hi);
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - base_lo);
            s[nt][1] = exp2f(s[nt][1] - base_lo);
            s[nt][2] = exp2f(s[nt][2] - base_hi);
            s[nt][3] = exp2f(s[nt][3] - base_hi);
            sum_lo += s[nt][0] + s[nt][1];
            sum_hi += s[nt][2] + s[nt][3];
        }
        l_lo = l_lo * alpha_lo + sum_lo;
        l_hi = l_hi * alpha_hi + sum_hi;
        m_lo = mn_lo;
        m_hi = mn_hi;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            acc_o[dt][0] *= alpha_lo;
            acc_o[dt][1] *= alpha_lo;
            acc_o[dt][2] *= alpha_hi;
            acc_o[dt][3] *= alpha_hi;
        }

        // O += P V: P's accumulators become A fragments in registers (two 8-key tiles per 16-key k-step);
        // B[k = key][n = d] = V[key][d], two keys of one column per register
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const unsigned int pa[4] = {Bits<T>::from_floats(s[2 * kk][0], s[2 * kk][1]),
                                        Bits<T>::from_floats(s[2 * kk][2], s[2 * kk][3]),
                                        Bits<T>::from_floats(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        Bits<T>::from_floats(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const unsigned short* vp = vs + (kk * 16 + 2 * tig) * LD + dt * 8 + g;
                const unsigned int bf[2] = {pack2(vp[0], vp[LD]), pack2(vp[8 * LD], vp[9 * LD])};
                mma_16816<T>(acc_o[dt], pa, bf);
            }
        }
        __syncthreads();  // every warp is done with stage j & 1 before iteration j + 1 prefetches into it
    }

    // l = Σ over the group's 4 lanes; O = acc / l, lse = (m' + log2 l) · ln 2; rows with l = 0 saw no key
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const float inv_lo = l_lo > 0.0f ? 1.0f / l_lo : 0.0f;
    const float inv_hi = l_hi > 0.0f ? 1.0f / l_hi : 0.0f;
    T* o_bh = o + static_cast<size_t>(bh) * Nq * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int col = dt * 8 + 2 * tig;
        if (row_lo < Nq)
            *reinterpret_cast<unsigned int*>(o_bh + static_cast<size_t>(row_lo) * D + col) =
                Bits<T>::from_floats(acc_o[dt][0] * inv_lo, acc_o[dt][1] * inv_lo);
        if (row_hi < Nq)
            *reinterpret_cast<unsigned int*>(o_bh + static_cast<size_t>(row_hi) * D + col) =
                Bits<T>::from_floats(acc_o[dt][2] * inv_hi, acc_o[dt][3] * inv_hi);
    }
    if (tig == 0) {
        float* lse_bh = lse + static_cast<size_t>(bh) * Nq;
        if (row_lo < Nq) lse_bh[row_lo] = l_lo > 0.0f ? (m_lo + __log2f(l_lo)) * LN2 : neg_inf();
        if (row_hi < Nq) lse_bh[row_hi] = l_hi > 0.0f ? (m_hi + __log2f(l_hi)) * LN2 : neg_inf();
    }
}

// The standard algorithm's softmax over S (rows, Nk) written by a matmul: P = softmax(scale · S + causal mask)
// in place, float32 inside; lse beside it. One block of THREADS threads per row; row r is query r % Nq.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_rows(T* __restrict__ s, float* __restrict__ lse, int Nq, int Nk, float scale, int causal) {
    __shared__ float red[THREADS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const int i = row % Nq;
    const int n_vis = causal ? min(Nk, max(0, i + Nk - Nq + 1)) : Nk;  // keys this query sees
    T* s_row = s + static_cast<size_t>(row) * Nk;

    // row max of the visible scaled scores (a shared-memory tree reduction)
    float m = neg_inf();
    for (int j = t; j < n_vis; j += THREADS) m = fmaxf(m, to_float<T>(s_row[j]) * scale);
    red[t] = m;
    __syncthreads();  // all partial maxima written
    for (int width = THREADS / 2; width > 0; width /= 2) {
        if (t < width) red[t] = fmaxf(red[t], red[t + width]);
        __syncthreads();  // this level done before the next reads it
    }
    m = red[0];
    __syncthreads();  // everyone has read the max before red is reused for the sums

    float total = 0.0f;
    for (int j = t; j < n_vis; j += THREADS) total += __expf(to_float<T>(s_row[j]) * scale - m);
    red[t] = total;
    __syncthreads();
    for (int width = THREADS / 2; width > 0; width /= 2) {
        if (t < width) red[t] += red[t + width];
        __syncthreads();
    }
    total = red[0];
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int j = t; j < Nk; j += THREADS) {
        const float p = j < n_vis ? __expf(to_float<T>(s_row[j]) * scale - m) * inv : 0.0f;
        s_row[j] = from_float<T>(p);
    }
    if (t == 0) lse[row] = total > 0.0f ? m + __logf(total) : neg_inf();
}

}  // namespace ioaware

#ifdef IOAWARE_INSTANTIATE_ALL  // the compile check (tests/kernels/test_cuda_compile.py) builds every variant
template __global__ void ioaware::flash_forward<__half, 64, 64, 64>(const __half*, const __half*, const __half*,
                                                                    __half*, float*, int, int, int, int, float, int);
template __global__ void ioaware::flash_forward<__half, 128, 64, 64>(const __half*, const __half*, const __half*,
                                                                     __half*, float*, int, int, int, int, float, int);
template __global__ void ioaware::flash_forward<__nv_bfloat16, 64, 64, 64>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, float*, int, int, int, int,
    float, int);
template __global__ void ioaware::flash_forward<__nv_bfloat16, 128, 64, 64>(
    const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*, float*, int, int, int, int,
    float, int);
template __global__ void ioaware::softmax_rows<__half, 256>(__half*, float*, int, int, float, int);
template __global__ void ioaware::softmax_rows<__nv_bfloat16, 256>(__nv_bfloat16*, float*, int, int, float, int);
#endif
