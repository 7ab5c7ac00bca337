// SnapKV on the GPU for CuPy's RawModule (Li et al. 2024, §4.2: observation-window voting, pooling, per-head
// selection, gather). Scores are float32; K and V are gathered in their own 16- or 32-bit type.
//
//   window_votes   one block per (batch, query head): for each window query i (position N − w + i), the row's max
//                  and Σ e^(s − max) over the keys it sees by block reductions, then every thread adds
//                  e^(s_ij − m_i) / l_i to the votes of the prefix keys it owns. Scores are recomputed in each
//                  pass (w · N · d multiply-adds, three times) rather than stored: an N-long row of one head
//                  does not fit shared memory at long prompts.
//   window_row_stats, window_column_votes   the same votes from S = Q_w Kᵀ computed once as a GEMM (cuBLAS, by
//                  the launcher): one block per window row for its max and Σ e^(s − max) over the keys it sees,
//                  then one thread per (head, prefix key) summing e^(s_ij − m_i) / l_i down its column of S, reads
//                  coalesced across the warp. w · N · d multiply-adds once instead of three times.
//   pool_rows      max or average over a centred window along positions (stride 1, padding kernel_size / 2;
//                  max ignores the padding, avg counts it as zeros), one thread per element.
//   group_mean     gqa="mean": a kv head's score is the mean of its query heads'.
//   topk_radix     one block per head: the n_keep-th largest score by a 4-pass radix select on the scores'
//                  order-preserving 32-bit keys (8 bits a pass, a 256-bin shared histogram), then the positions
//                  above it and, of those equal to it, the lowest, written in ascending order by two block-wide
//                  prefix sums per chunk; the observation window follows. O(N) per head and exact with the CPU
//                  tier's tie rule; the Numba-CUDA tier's O(N²) rank count is the readable version of it.
//   gather_rows    k_c[b, h, s] = k[b, kv(h), kept[b, h, s]] and the same for v.

namespace ioaware {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

template <int THREADS>
__device__ __forceinline__ float block_reduce(float value, float* red, bool take_max) {
    const int t = threadIdx.x;
    red[t] = value;
    __syncthreads();  // all partial values written
    for (int width = THREADS / 2; width > 0; width /= 2) {
        if (t < width) red[t] = take_max ? fmaxf(red[t], red[t + width]) : red[t] + red[t + width];
        __syncthreads();  // this level done before the next reads it
    }
    const float result = red[0];
    __syncthreads();  // everyone has read the result before red is written again
    return result;
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
window_votes(const float* __restrict__ qw, const float* __restrict__ k, int Hq, int Hkv, int w, int N, int d,
             float scale, float* __restrict__ votes) {
    extern __shared__ float q_s[];  // (d): the current window query
    __shared__ float red[THREADS];
    const int bh = blockIdx.x;
    const int b = bh / Hq, h = bh % Hq;
    const int t = threadIdx.x;
    const int P = N - w;  // prefix positions that can be pruned
    const float* k_bh = k + static_cast<size_t>(b * Hkv + h / (Hq / Hkv)) * N * d;
    float* votes_bh = votes + static_cast<size_t>(bh) * P;
    for (int j = t; j < P; j += THREADS) votes_bh[j] = 0.0f;
    for (int i = 0; i < w; ++i) {
        for (int c = t; c < d; c += THREADS) q_s[c] = qw[(static_cast<size_t>(bh) * w + i) * d + c];
        __syncthreads();  // the query is in shared memory
        const int n_vis = P + i + 1;  // causal inside the window
        float m = neg_inf();
        for (int j = t; j < n_vis; j += THREADS) {
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s += q_s[c] * k_bh[static_cast<size_t>(j) * d + c];
            m = fmaxf(m, s * scale);
        }
        m = block_reduce<THREADS>(m, red, true);
        float total = 0.0f;
        for (int j = t; j < n_vis; j += THREADS) {
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s += q_s[c] * k_bh[static_cast<size_t>(j) * d + c];
            total += __expf(s * scale - m);
        }
        total = block_reduce<THREADS>(total, red, false);
        const float inv = 1.0f / total;
        for (int j = t; j < P; j += THREADS) {  // the votes for the prefix (each position owned by one thread)
            float s = 0.0f;
            for (int c = 0; c < d; ++c) s += q_s[c] * k_bh[static_cast<size_t>(j) * d + c];
            votes_bh[j] += __expf(s * scale - m) * inv;
        }
        __syncthreads();  // q_s is rewritten for the next query
    }
}

// s: (B·Hq·w, N) scores q·k (unscaled); row r is window query i = r % w, which sees keys j < N − w + i + 1
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
window_row_stats(const float* __restrict__ s, int w, int N, float scale, float* __restrict__ row_max,
                 float* __restrict__ row_sum) {
    __shared__ float red[THREADS];
    const int r = blockIdx.x;
    const int t = threadIdx.x;
    const int n_vis = N - w + r % w + 1;  // causal inside the window
    const float* s_row = s + static_cast<size_t>(r) * N;
    float m = neg_inf();
    for (int j = t; j < n_vis; j += THREADS) m = fmaxf(m, s_row[j] * scale);
    m = block_reduce<THREADS>(m, red, true);
    float total = 0.0f;
    for (int j = t; j < n_vis; j += THREADS) total += __expf(s_row[j] * scale - m);
    total = block_reduce<THREADS>(total, red, false);
    if (t == 0) {
        row_max[r] = m;
        row_sum[r] = total;
    }
}

// votes (B·Hq, P = N − w): the column sums of the window's softmax over the prefix keys, one thread per entry
__global__ void window_column_votes(const float* __restrict__ s, const float* __restrict__ row_max,
                                    const float* __restrict__ row_sum, int rows, int w, int N, float scale,
                                    float* __restrict__ votes) {
    const int P = N - w;
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over (B·Hq, P)
    if (idx >= static_cast<size_t>(rows) * P) return;
    const size_t bh = idx / P;
    const int j = static_cast<int>(idx % P);
    float acc = 0.0f;
    for (int i = 0; i < w; ++i) {  // every window query sees every prefix key
        const size_t r = bh * w + i;
        acc += __expf(s[r * N + j] * scale - row_max[r]) * (1.0f / row_sum[r]);
    }
    votes[idx] = acc;
}

__global__ void pool_rows(const float* __restrict__ x, int R, int P, int kernel_size, int use_max,
                          float* __restrict__ out) {
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<size_t>(R) * P) return;
    const int j = static_cast<int>(idx % P);
    const float* row = x + (idx - j);
    const int pad = kernel_size / 2;
    const int lo = max(0, j - pad), hi = min(P, j + pad + 1);
    float acc = use_max ? neg_inf() : 0.0f;
    for (int u = lo; u < hi; ++u) acc = use_max ? fmaxf(acc, row[u]) : acc + row[u];
    out[idx] = use_max ? acc : acc / kernel_size;
}

__global__ void group_mean(const float* __restrict__ x, int B, int G, int group, int P, float* __restrict__ out) {
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over (B, G, P)
    if (idx >= static_cast<size_t>(B) * G * P) return;
    const int j = static_cast<int>(idx % P);
    const size_t bg = idx / P;  // b · G + g; its query heads are rows (b · G + g) · group + u of x
    float acc = 0.0f;
    for (int u = 0; u < group; ++u) acc += x[(bg * group + u) * P + j];
    out[idx] = acc / group;
}

// larger float -> larger unsigned key (IEEE 754 bit patterns, sign-flipped)
__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exclusive prefix sum of one value per thread over the block (Hillis–Steele in shared memory); returns the
// thread's exclusive sum and writes the block total into *total
template <int THREADS>
__device__ __forceinline__ int block_exclusive_scan(int value, int* buf, int* total) {
    const int t = threadIdx.x;
    buf[t] = value;
    __syncthreads();  // every value written
    for (int offset = 1; offset < THREADS; offset *= 2) {
        const int add = t >= offset ? buf[t - offset] : 0;
        __syncthreads();  // everyone has read before anyone writes this level
        buf[t] += add;
        __syncthreads();  // this level written before the next reads it
    }
    const int inclusive = buf[t];
    *total = buf[THREADS - 1];
    __syncthreads();  // everyone has read the totals before buf is reused
    return inclusive - value;
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
topk_radix(const float* __restrict__ scores, int P, int n_keep, int window, int N, long long* __restrict__ kept) {
    __shared__ int hist[256];
    __shared__ int scan_buf[THREADS];
    __shared__ unsigned int chosen_prefix;
    __shared__ int chosen_remaining;
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const float* s = scores + static_cast<size_t>(row) * P;
    long long* out = kept + static_cast<size_t>(row) * (n_keep + window);

    if (n_keep > 0) {
        // radix select: the key of the n_keep-th largest score, 8 bits a pass from the top
        unsigned int prefix = 0, mask = 0;
        int remaining = n_keep;  // how many still to take among keys matching the prefix
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int bin = t; bin < 256; bin += THREADS) hist[bin] = 0;
            __syncthreads();  // histogram cleared
            for (int j = t; j < P; j += THREADS) {
                const unsigned int key = order_key(s[j]);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
            }
            __syncthreads();  // histogram complete
            if (t == 0) {
                int above = 0;
                int bin = 255;
                for (; bin > 0 && above + hist[bin] < remaining; --bin) above += hist[bin];
                chosen_prefix = prefix | (static_cast<unsigned int>(bin) << shift);
                chosen_remaining = remaining - above;
            }
            __syncthreads();  // the chosen bin is visible to all
            prefix = chosen_prefix;
            remaining = chosen_remaining;
            mask |= 255u << shift;
        }
        // compaction in position order: keys above the threshold, then the lowest `remaining` equal to it
        int written = 0, equal_seen = 0;
        for (int j0 = 0; j0 < P; j0 += THREADS) {
            const int j = j0 + t;
            const unsigned int key = j < P ? order_key(s[j]) : 0u;
            const int is_equal = j < P && key == prefix;
            int equal_total;
            const int equal_before = equal_seen + block_exclusive_scan<THREADS>(is_equal, scan_buf, &equal_total);
            const int keep = j < P && (key > prefix || (is_equal && equal_before < remaining));
            int keep_total;
            const int slot = written + block_exclusive_scan<THREADS>(keep, scan_buf, &keep_total);
            if (keep) out[slot] = j;
            written += keep_total;
            equal_seen += equal_total;
        }
    }
    for (int u = t; u < window; u += THREADS) out[n_keep + u] = N - window + u;  // the observation window
}

template <typename E>
__global__ void gather_rows(const E* __restrict__ k, const E* __restrict__ v, const long long* __restrict__ kept,
                            int B, int H, int Hkv, int N, int C, int d, E* __restrict__ k_c,
                            E* __restrict__ v_c) {
    const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // over (B, H, C, d)
    const size_t total = static_cast<size_t>(B) * H * C * d;
    if (idx >= total) return;
    const int c = static_cast<int>(idx % d);
    const size_t slot = idx / d;  // (b · H + h) · C + s
    const size_t bh = slot / C;
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    const long long pos = kept[slot];
    const size_t src = ((static_cast<size_t>(b) * Hkv + h / (H / Hkv)) * N + pos) * d + c;
    k_c[idx] = k[src];
    v_c[idx] = v[src];
}

}  // namespace ioaware

#ifdef IOAWARE_INSTANTIATE_ALL  // the compile check (tests/kernels/test_cuda_compile.py) builds every variant
template __global__ void ioaware::window_votes<256>(const float*, const float*, int, int, int, int, int, float,
                                                    float*);
template __global__ void ioaware::window_row_stats<256>(const float*, int, int, float, float*, float*);
template __global__ void ioaware::topk_radix<256>(const float*, int, int, int, int, long long*);
template __global__ void ioaware::gather_rows<unsigned short>(const unsigned short*, const unsigned short*,
                                                             const long long*, int, int, int, int, int, int,
                                                             unsigned short*, unsigned short*);
template __global__ void ioaware::gather_rows<float>(const float*, const float*, const long long*, int, int, int,
                                                     int, int, int, float*, float*);
#endif
