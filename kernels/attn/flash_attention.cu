// FlashAttention-2 forward on tensor cores, and the standard algorithm's softmax, for CuPy's RawModule.
//
// flash_forward: Dao, "FlashAttention-2" (2023), Algorithm 1. One block of BR / 16 warps per (batch · query
// head, query tile of BR rows, key split); warp w owns rows 16w .. 16w + 15 of the tile. The grid is (Tr·B·Hq,
// n_splits), the query tile fastest on x (whose limit is 2^31 − 1; y stops at 65535), as flash-attn launches its
// forward (run_flash_fwd: grid (num_m_block, b, h)): the blocks the GPU runs at once are then the tiles of a few
// heads, which read the same K and V tiles, so that K and V come from DRAM about once and are re-read from L2
// (``simulator.costs.reuse``). With the heads fastest (before), the blocks in flight read every head's K and V
// at once, more than L2 holds: ncu on an H200 counted 4.5x the model's DRAM bytes at B = 1, H = 16, N = 8192,
// d = 128, its reads beyond Q about 8 times K and V (reports/gpu/2026-12-04T1824-h200; the total only, not counted
// per tensor). flash-attn's grid is (tile, b, h), this one (tile, h, b): the same at B = 1. Q is loaded once into
// shared memory and then into registers as mma.sync A fragments; K and V tiles of BC keys stream through two
// shared stages with cp.async, so the next tile is in flight while the tensor cores work on the current one.
// Fragments come from shared memory by ldmatrix (PTX ISA, "ldmatrix": four 8 × 8 16-bit matrices per instruction,
// each lane holding one 32-bit word of each): Q and K as stored, V with .trans, since the B operand of P V pairs
// two keys of one column in a register.
// S = Q Kᵀ and O += P V are mma.sync.m16n8k16 (float16 or bfloat16 in, float32 accumulate, PTX ISA §9.7.14),
// with P handed from the S accumulators to the A operand of the second product in registers (FlashAttention-2
// §3.1: no shared-memory round trip for P). The softmax runs in the log2 domain: s' = s · scale · log2(e),
// p = 2^(s' − m'), lse = (m' + log2 l) · ln 2. Causal: the mask is aligned bottom-right (row i sees keys
// j <= i + Nk − Nq) and the key loop stops at the last key the tile's last row can see. A row that sees no key
// writes zeros and lse = −inf. GQA: query head h reads kv head h / (Hq / Hkv).
//
// Split-KV (Flash-Decoding; Dao et al. 2023, "Flash-Decoding for long-context inference"): with n_splits > 1 the
// keys a tile sees are cut into n_splits ranges of whole BC tiles, one block each, so that decode (a few query
// rows) still fills the machine; each block writes its rows' normalized partial output and lse in float32, and
// flash_combine merges them: lse = log Σ_s e^(lse_s), o = Σ_s e^(lse_s − lse) o_s.
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

// ldmatrix.x4: lanes 8i .. 8i + 7 give the row addresses of matrix i (16-byte aligned rows of 8 16-bit values);
// lane l receives r[i] = the 32-bit word (row l / 4, values 2·(l % 4), +1) of matrix i, or with .trans the values
// (rows 2·(l % 4) and 2·(l % 4) + 1, column l / 4) of matrix i (PTX ISA, "Warp-level matrix load instruction:
// ldmatrix")
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const unsigned short* row) {
    const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const unsigned short* row) {
    const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

// Shared memory, in 16-bit elements: Q (BR rows), then K and V, two stages of BC rows each; every row padded by
// PAD elements (16 bytes) so that the 8 rows a fragment load touches fall in different banks.
template <int D> struct Rows {
    static constexpr int PAD = 8;
    static constexpr int LD = D + PAD;
    static constexpr int CHUNKS = D / 8;  // 16-byte cp.async chunks per row
};

// o_part (n_splits, B·Hq, Nq, D) and lse_part (n_splits, B·Hq, Nq), float32, are written instead of o and lse
// when n_splits > 1 (and may be null otherwise)
template <typename T, int D, int BR, int BC>
__global__ void __launch_bounds__(BR / 16 * 32)
flash_forward(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
              float* __restrict__ lse, float* __restrict__ o_part, float* __restrict__ lse_part, int Hq, int Hkv,
              int Nq, int Nk, float scale_log2, int causal) {
    constexpr int THREADS = BR / 16 * 32;
    constexpr int LD = Rows<D>::LD;
    constexpr int CHUNKS = Rows<D>::CHUNKS;
    static_assert(D % 32 == 0 && BC % 16 == 0 && BR % 16 == 0, "tiles are whole mma shapes, x4 loads pair them");
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned short* q_s = reinterpret_cast<unsigned short*>(smem);  // (BR, LD)
    unsigned short* k_s = q_s + BR * LD;                              // (2, BC, LD)
    unsigned short* v_s = k_s + 2 * BC * LD;                          // (2, BC, LD)

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;    // groupID: the row (and B column) this lane's fragments start at
    const int tig = lane % 4;  // thread in group: the column pair
    const int Tr = (Nq + BR - 1) / BR;
    const int m0 = static_cast<int>(blockIdx.x % Tr) * BR;
    const int bh = static_cast<int>(blockIdx.x / Tr);  // b · Hq + h
    const int n_bh = static_cast<int>(gridDim.x / Tr);  // B · Hq
    const int split = blockIdx.y, n_splits = gridDim.y;
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

    // the keys this tile needs: all, or (causal) up to the last one its last row sees — later tiles are skipped;
    // of those tiles, this split's share [j_begin, j_end)
    const int k_end = causal ? min(Nk, max(0, min(m0 + BR, Nq) + offset)) : Nk;
    const int Tc = (k_end + BC - 1) / BC;
    const int per_split = (Tc + n_splits - 1) / n_splits;
    const int j_begin = min(Tc, split * per_split);
    const int j_end = min(Tc, j_begin + per_split);
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
    if (j_begin < j_end) load_kv(j_begin, j_begin & 1);
    cp_async_commit();
    cp_async_wait<1>();  // the Q group has landed (the first K/V group may still be in flight)
    __syncthreads();     // every thread's part of Q is in shared memory before anyone reads fragments

    // Q as A fragments, kept in registers for the whole key loop: (D / 16 k-steps, 4 registers). One ldmatrix.x4
    // per k-step: lane l points at row l % 16 of the warp's 16 rows, columns (l / 16) · 8 .. +7, so matrices 0..3
    // are (rows 0-7, 8-15) × (columns 0-7, 8-15) of the 16 × 16 step: a0, a1, a2, a3 of the A layout above
    const int r_lo = warp * 16 + g;
    const int r_hi = r_lo + 8;
    const int mat = lane / 8, mat_row = lane % 8;  // the ldmatrix matrix this lane addresses, and its row there
    unsigned int qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], q_s + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);

    const int row_lo = m0 + r_lo;
    const int row_hi = m0 + r_hi;
    float acc_o[D / 8][4];  // this warp's 16 × D output, unnormalized (Σ_j 2^(s'_j − m') v_j)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) acc_o[dt][0] = acc_o[dt][1] = acc_o[dt][2] = acc_o[dt][3] = 0.0f;
    float m_lo = neg_inf(), m_hi = neg_inf();  // running max m' of rows r_lo and r_hi (log2 domain)
    float l_lo = 0.0f, l_hi = 0.0f;        // this lane's part of the running sums l (summed over tig at the end)

    for (int j = j_begin; j < j_end; ++j) {
        // prefetch tile j + 1 into the other stage, then wait for tile j (an empty group keeps the count right)
        if (j + 1 < j_end) load_kv(j + 1, (j + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // tile j is in shared memory for every warp
        const unsigned short* ks = k_s + (j & 1) * BC * LD;
        const unsigned short* vs = v_s + (j & 1) * BC * LD;

        // S = Q Kᵀ for this warp's 16 rows and the tile's BC keys: B[k = d][n = key] = K[key][d], so b0 and b1 are
        // words of K's rows as stored. One ldmatrix.x4 covers two k-steps of one 8-key tile: lane l points at key
        // nt·8 + l % 8, columns kk·16 + (l / 8) · 8, so matrices 0..3 are b0, b1 of step kk and b0, b1 of kk + 1
        float s[BC / 8][4];
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk += 2) {
                unsigned int kf[4];
                ldmatrix_x4(kf, ks + (nt * 8 + mat_row) * LD + kk * 16 + mat * 8);
                const unsigned int b_even[2] = {kf[0], kf[1]}, b_odd[2] = {kf[2], kf[3]};
                mma_16816<T>(s[nt], qf[kk], b_even);
                mma_16816<T>(s[nt], qf[kk + 1], b_odd);
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
        // B[k = key][n = d] = V[key][d], two keys of one column per register: ldmatrix .trans of V as stored.
        // One x4 covers two 8-column tiles: lane l points at key kk·16 + (l / 8 % 2) · 8 + l % 8, columns
        // dt·8 + (l / 16) · 8, so matrices 0..3 are b0, b1 of column tile dt and b0, b1 of dt + 1
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            const unsigned int pa[4] = {Bits<T>::from_floats(s[2 * kk][0], s[2 * kk][1]),
                                        Bits<T>::from_floats(s[2 * kk][2], s[2 * kk][3]),
                                        Bits<T>::from_floats(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                        Bits<T>::from_floats(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dt = 0; dt < D / 8; dt += 2) {
                unsigned int vf[4];
                ldmatrix_x4_trans(vf, vs + (kk * 16 + (mat % 2) * 8 + mat_row) * LD + dt * 8 + (mat / 2) * 8);
                const unsigned int b_even[2] = {vf[0], vf[1]}, b_odd[2] = {vf[2], vf[3]};
                mma_16816<T>(acc_o[dt], pa, b_even);
                mma_16816<T>(acc_o[dt + 1], pa, b_odd);
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
    // lse: −inf for a row that saw no key (l = 0), NaN for a row a NaN reached (l = NaN), so the combine sees it
    const float lse_lo = l_lo > 0.0f ? (m_lo + __log2f(l_lo)) * LN2 : (l_lo == 0.0f ? neg_inf() : l_lo);
    const float lse_hi = l_hi > 0.0f ? (m_hi + __log2f(l_hi)) * LN2 : (l_hi == 0.0f ? neg_inf() : l_hi);
    if (n_splits > 1) {  // this split's normalized partial rows, float32, for flash_combine
        const size_t part = (static_cast<size_t>(split) * n_bh + bh) * Nq;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
            const int col = dt * 8 + 2 * tig;
            if (row_lo < Nq)
                *reinterpret_cast<float2*>(o_part + (part + row_lo) * D + col) =
                    make_float2(acc_o[dt][0] * inv_lo, acc_o[dt][1] * inv_lo);
            if (row_hi < Nq)
                *reinterpret_cast<float2*>(o_part + (part + row_hi) * D + col) =
                    make_float2(acc_o[dt][2] * inv_hi, acc_o[dt][3] * inv_hi);
        }
        if (tig == 0) {
            if (row_lo < Nq) lse_part[part + row_lo] = lse_lo;
            if (row_hi < Nq) lse_part[part + row_hi] = lse_hi;
        }
        return;
    }
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
        if (row_lo < Nq) lse_bh[row_lo] = lse_lo;
        if (row_hi < Nq) lse_bh[row_hi] = lse_hi;
    }
}

// Split-KV's second step: one thread per (row, column) of o over rows = B·Hq·Nq. lse = m + log Σ_s e^(lse_s − m)
// with m the largest lse_s; o = Σ_s e^(lse_s − lse) o_s. A row no split saw (every lse_s = −inf) gets zeros and
// lse = −inf, as the unsplit kernel writes it; a NaN in any split's lse or o makes the row NaN (fmaxf alone would
// drop it), as the unsplit kernel's row would be.
template <typename T, int D>
__global__ void flash_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                              T* __restrict__ o, float* __restrict__ lse, int rows, int n_splits) {
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over (rows, D)
    if (idx >= static_cast<size_t>(rows) * D) return;
    const size_t row = idx / D;
    const int col = static_cast<int>(idx % D);
    float m = neg_inf();
    bool nan = false;
    for (int sp = 0; sp < n_splits; ++sp) {
        const float x = lse_part[sp * static_cast<size_t>(rows) + row];
        nan |= x != x;
        m = fmaxf(m, x);
    }
    float total = 0.0f, acc = 0.0f;
    if (nan) {
        total = acc = m = __int_as_float(0x7fc00000);  // a quiet NaN, for o and lse alike
    } else if (m != neg_inf()) {
        for (int sp = 0; sp < n_splits; ++sp) {
            const size_t at = sp * static_cast<size_t>(rows) + row;
            const float w = __expf(lse_part[at] - m);  // e^(−inf) = 0 for a split that saw no key of this row
            total += w;
            acc += w * o_part[at * D + col];
        }
    }
    const bool seen = nan || total > 0.0f;
    o[idx] = from_float<T>(seen ? acc / total : 0.0f);
    if (col == 0) lse[row] = seen ? m + __logf(total) : neg_inf();
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
#define IOAWARE_FLASH(T, D)                                                                                        \
    template __global__ void ioaware::flash_forward<T, D, 64, 64>(const T*, const T*, const T*, T*, float*, float*, \
                                                                   float*, int, int, int, int, float, int);        \
    template __global__ void ioaware::flash_combine<T, D>(const float*, const float*, T*, float*, int, int);
IOAWARE_FLASH(__half, 64)
IOAWARE_FLASH(__half, 128)
IOAWARE_FLASH(__nv_bfloat16, 64)
IOAWARE_FLASH(__nv_bfloat16, 128)
#undef IOAWARE_FLASH
template __global__ void ioaware::softmax_rows<__half, 256>(__half*, float*, int, int, float, int);
template __global__ void ioaware::softmax_rows<__nv_bfloat16, 256>(__nv_bfloat16*, float*, int, int, float, int);
#endif
