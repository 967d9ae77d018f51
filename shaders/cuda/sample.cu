// Token selection on the device (ARCHITECTURE.md §3): the next token id is written straight into
// the buffer the next step's embedding reads, so decode needs no host round trip.
//
// argmax_logprob: over logits [V] (fp32): the first index of the maximum, and its log-probability
//   log softmax(logits)[id] = -log Σ exp(l - max). One block of 1024 threads; bytes: V·4 read twice.
// advance_pos: the sequence's position += n (one thread), so graph replays see the new position.
//
// Sampling with the host Sampler's exact steps (lily-core/src/sampling.rs), top_k in 1..=PICK_MAX_K:
// sample_adjust: [V] grid, 256 threads: logit_bias (ids sorted stably, so repeated ids add in the
//   request's order), repetition / presence / frequency penalties from hist[V] (bits 0..30: times
//   generated, bit 31: seen by the repetition penalty), then × 1/temperature, into scaled[V].
//   Every operation is an explicit _rn intrinsic so nvcc never fuses what the host rounds twice.
// sample_pick: one block of 1024 threads: radix select (4 passes of 8 bits over f32::total_cmp
//   keys) of the top_k largest scaled values, ties at the threshold broken by lower index as the
//   host's sort does; then on ≤ 256 candidates: weights exp(v - max) (double exp rounded to
//   fp32, the closest we get to the host's libm expf), top_p, min_p and the inverse-CDF pick with
//   the host-drawn uniform, all in the host's order and precision (f64 sums). Writes the token, its
//   log-probability under the raw logits, and bumps hist[token] as Sampler::accept does.
//   Bytes: scaled[V] read 5 times, logits[V] twice (L2 keeps them).

#ifndef SAMPLE_THREADS
#error "SAMPLE_THREADS comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
argmax_logprob(const float* __restrict__ logits, int vocab, int* __restrict__ token_out,
               float* __restrict__ logprob_out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = logits[i];
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
    warp_argmax(best, best_i);
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        best_i = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(best, best_i);
        if (lane == 0) {
            sv[0] = best;
            si[0] = best_i;
        }
    }
    __syncthreads();
    float mx = sv[0];
    int id = si[0];
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(logits[i] - mx);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        *token_out = id < vocab ? id : 0;
        *logprob_out = -logf(s);
    }
}

// hist[] entries: bits 0..30 times generated, bit 31 seen by the repetition penalty.
#define HIST_SEEN 0x80000000u
#define HIST_COUNT 0x7fffffffu

// The same over many blocks (decode: one block reading 1 MB of logits took ~0.1 ms), also for
// greedy picks on adjusted logits (penalties, logit_bias: `keys` = sample_adjust's output):
// argmax_part: grid ARGMAX_BLOCKS, block 256; block b takes a contiguous slice of the vocabulary and
//   writes parts[4b..] = (its largest key, the key's first index as int bits, its largest logit,
//   Σ exp(logit − that)).
// argmax_final: one block of ARGMAX_BLOCKS threads: the first index of the overall largest key, its
//   log-probability under the logits, logit − M − log Σ_b sum_b · exp(max_b − M); with `hist`, bumps
//   hist[token] as sample_pick does.
#ifndef ARGMAX_BLOCKS
#error "ARGMAX_BLOCKS comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif

// (value, index) of the larger value, the lower index on ties, over the whole block; every thread
// gets the result.
__device__ __forceinline__ void block_argmax(float& best, int& best_i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(best, best_i);
    __syncthreads();
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = best_i;
    }
    __syncthreads();
    best = lane < nw ? sv[lane] : NEG_INF;
    best_i = lane < nw ? si[lane] : 0x7fffffff;
    warp_argmax(best, best_i);
}

extern "C" __global__ void __launch_bounds__(256)
argmax_part(const float* __restrict__ keys, const float* __restrict__ logits, int vocab, float* __restrict__ parts) {
    pdl_wait();
    int per = (vocab + gridDim.x - 1) / gridDim.x;
    int lo = blockIdx.x * per, hi = min(vocab, lo + per);
    float best = NEG_INF, lmax = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = keys[i];
        if (v > best) {
            best = v;
            best_i = i;
        }
        lmax = fmaxf(lmax, logits[i]);
    }
    block_argmax(best, best_i);
    __syncthreads();
    {
        __shared__ float mx_s[32];
        lmax = warp_max(lmax);
        if ((threadIdx.x & 31) == 0) mx_s[threadIdx.x >> 5] = lmax;
        __syncthreads();
        lmax = (threadIdx.x & 31) < (blockDim.x >> 5) ? mx_s[threadIdx.x & 31] : NEG_INF;
        lmax = warp_max(lmax);
    }
    float s = 0.0f;
    if (lmax != NEG_INF)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += expf(logits[i] - lmax);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        parts[4 * blockIdx.x] = best;
        parts[4 * blockIdx.x + 1] = __int_as_float(best_i);
        parts[4 * blockIdx.x + 2] = lmax;
        parts[4 * blockIdx.x + 3] = s;
    }
}

extern "C" __global__ void __launch_bounds__(ARGMAX_BLOCKS)
argmax_final(const float* __restrict__ parts, int n_parts, const float* __restrict__ logits, int vocab,
             int* __restrict__ token_out, float* __restrict__ logprob_out, u32* __restrict__ hist, int remember) {
    pdl_wait();
    __shared__ float m_s[32];
    int t = threadIdx.x;
    float best = t < n_parts ? parts[4 * t] : NEG_INF;
    int best_i = t < n_parts ? __float_as_int(parts[4 * t + 1]) : 0x7fffffff;
    block_argmax(best, best_i);
    float m = t < n_parts ? parts[4 * t + 2] : NEG_INF;
    float mm = warp_max(m);
    __syncthreads();
    if ((t & 31) == 0) m_s[t >> 5] = mm;
    __syncthreads();
    mm = (t & 31) < (blockDim.x >> 5) ? m_s[t & 31] : NEG_INF;
    mm = warp_max(mm);
    float s = (t < n_parts && m != NEG_INF) ? parts[4 * t + 3] * expf(m - mm) : 0.0f;
    s = block_sum(s);
    if (t == 0) {
        int token = best_i < vocab ? best_i : 0;
        *token_out = token;
        *logprob_out = (logits[token] - mm) - logf(s);
        if (hist) {
            u32 h = hist[token];
            u32 n = (h & HIST_COUNT) + 1u;
            hist[token] = (h & HIST_SEEN) | (n & HIST_COUNT) | (remember ? HIST_SEEN : 0u);
        }
    }
}

// A constrained step: keys[i] = src[i] where the constraint's bitset allows token i (bit i % 32
// of words[i / 32], lily-core's TokenMask), else -inf; src may be keys. The pick then runs on
// keys while the log-probability stays that of the raw logits, as on the host.
extern "C" __global__ void sample_mask(const float* src, const u32* __restrict__ words, int vocab, float* keys) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    keys[i] = ((words[i >> 5] >> (i & 31)) & 1u) ? src[i] : NEG_INF;
}

extern "C" __global__ void advance_pos(int* pos, int n) {
    pdl_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) *pos += n;
}

// advance_pos_rows: *pos[i] += n for the rows sequences of a batched decode step (pos: a table of
// their position pointers), one thread each. grid ceil(rows / 128), block 128.
extern "C" __global__ void advance_pos_rows(int* const* pos, int rows, int n) {
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows) *pos[i] += n;
}

#ifndef PICK_MAX_K
#error "PICK_MAX_K comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif

// Larger key = later in f32::total_cmp order (NaNs are filtered out before).
__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// One radix-select pass, after its histogram (bins: byte `shift` of the keys that match prefix
// under mask): the bin holding the remaining-th largest key. Every thread of the block calls it;
// prefix, remaining and mask move to that bin, and sel[2] (shared) holds its count (the ties once
// the last byte is done). sel: 3 words of shared memory.
// The search: one thread walking the 256 bins from the top (≈ 4 µs of shared-memory latency a
// pass, four passes in each of sample_part and sample_pick_parts), or with SAMPLE_WARP_SCAN (the
// plan's `warp_scan_sampling`) one warp: lane l sums bins 255 − 8l … 248 − 8l, a shuffle scan
// finds the lane where the count from the top reaches `remaining`, and that lane walks its 8.
__device__ __forceinline__ void radix_narrow(const u32* bins, int shift, u32& prefix, u32& remaining, u32& mask,
                                             u32* sel) {
#if defined(SAMPLE_WARP_SCAN) && SAMPLE_WARP_SCAN
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        u32 c[8], own = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            c[i] = bins[255 - 8 * lane - i];
            own += c[i];
        }
        u32 incl = own;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u32 v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        u32 hit = __ballot_sync(0xffffffffu, incl >= remaining);
        if (hit != 0u && lane == __ffs(hit) - 1) {
            u32 cum = incl - own;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                if (cum + c[i] >= remaining) {
                    sel[0] = prefix | ((u32)(255 - 8 * lane - i) << shift);
                    sel[1] = remaining - cum;
                    sel[2] = c[i];
                    break;
                }
                cum += c[i];
            }
        }
    }
#else
    if (threadIdx.x == 0) {
        u32 cum = 0;
        for (int b = 255; b >= 0; b--) {
            u32 c = bins[b];
            if (cum + c >= remaining) {
                sel[0] = prefix | ((u32)b << shift);
                sel[1] = remaining - cum;
                sel[2] = c;
                break;
            }
            cum += c;
        }
    }
#endif
    __syncthreads();
    prefix = sel[0];
    remaining = sel[1];
    mask |= 0xffu << shift;
    __syncthreads();
}

extern "C" __global__ void sample_adjust(const float* __restrict__ logits, int vocab,
                                         const u32* __restrict__ hist,
                                         const int* __restrict__ bias_ids,
                                         const float* __restrict__ bias_vals, int n_bias,
                                         float repetition, float presence, float frequency,
                                         float inv_t, float* __restrict__ scaled) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    float v = logits[i];
    if (n_bias > 0) {
        int lo = 0, hi = n_bias;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (bias_ids[mid] < i) lo = mid + 1;
            else hi = mid;
        }
        for (; lo < n_bias && bias_ids[lo] == i; lo++) v = __fadd_rn(v, bias_vals[lo]);
    }
    u32 h = hist[i];
    if ((h & HIST_SEEN) && repetition != 1.0f)
        v = v > 0.0f ? __fdiv_rn(v, repetition) : __fmul_rn(v, repetition);
    u32 n = h & HIST_COUNT;
    if (n > 0) v = __fsub_rn(v, __fadd_rn(presence, __fmul_rn(frequency, __uint2float_rn(n))));
    scaled[i] = __fmul_rn(v, inv_t);
}

// Sorts cand (value, id) pairs into out by (key desc, id asc): a rank sort, k ≤ PICK_MAX_K.
__device__ __forceinline__ void rank_sort(const float* val, const int* id, int k, float* out_v,
                                          int* out_i) {
    for (int t = threadIdx.x; t < k; t += blockDim.x) {
        u32 kt = order_key(val[t]);
        int it = id[t], rank = 0;
        for (int j = 0; j < k; j++) {
            u32 kj = order_key(val[j]);
            rank += (kj > kt || (kj == kt && id[j] < it)) ? 1 : 0;
        }
        out_v[rank] = val[t];
        out_i[rank] = it;
    }
}

// The pick over n candidates vals[i] (scaled values; their token ids are ids[i], or i itself
// when ids is null) in ascending token order, so "lower index" is "lower token id". With ids
// null the raw logits' maximum mx and exp-sum se come from logits [vocab] here; with ids they
// are given (sample_part's partials).
__device__ __forceinline__ void pick_core(const float* __restrict__ logits, const float* scaled, const int* ids,
                                          int vocab, int top_k, float top_p, float min_p, double u,
                                          int remember, u32* __restrict__ hist, int* __restrict__ token_out,
                                          float* __restrict__ logprob_out, float mx_in, float se_in) {
    __shared__ u32 bins[256];
    __shared__ u32 s_sel[3], s_valid, s_n, s_taken;
    __shared__ u32 warp_n[32];
    __shared__ float cv[PICK_MAX_K], sv[PICK_MAX_K];
    __shared__ int ci[PICK_MAX_K], si[PICK_MAX_K];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        s_valid = 0;
        s_n = 0;
        s_taken = 0;
        s_sel[2] = 0;
    }
    __syncthreads();

    // Valid (non-NaN) candidates, and the raw logits' maximum for the log-probability.
    u32 nv = 0;
    float mx = NEG_INF;
    for (int i = tid; i < vocab; i += blockDim.x) {
        nv += isnan(scaled[i]) ? 0u : 1u;
        if (!ids) mx = fmaxf(mx, logits[i]);
    }
    atomicAdd(&s_valid, nv);
    if (ids) {
        mx = mx_in;
    } else {
        mx = warp_max(mx);
        if (lane == 0) cv[warp] = mx;
        __syncthreads();
        mx = cv[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) mx = fmaxf(mx, cv[w]);
    }
    __syncthreads();
    u32 k = min(min((u32)top_k, (u32)PICK_MAX_K), s_valid);
    __syncthreads();
    // Radix select: after 4 passes, prefix = the k-th largest key, remaining = how many of the
    // elements equal to it belong to the top k, ties = how many there are.
    u32 prefix = 0, mask = 0, remaining = k;
    if (k > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int j = tid; j < 256; j += blockDim.x) bins[j] = 0;
            __syncthreads();
            for (int base = 0; base < vocab; base += blockDim.x) {
                int i = base + tid;
                u32 bin = 256;
                if (i < vocab) {
                    float v = scaled[i];
                    u32 key = order_key(v);
                    if (!isnan(v) && (key & mask) == prefix) bin = (key >> shift) & 0xffu;
                }
                // Warp-aggregated: the top bytes of similar logits all land in one bin.
                u32 peers = __match_any_sync(0xffffffffu, bin);
                if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&bins[bin], __popc(peers));
            }
            __syncthreads();
            radix_narrow(bins, shift, prefix, remaining, mask, s_sel);
        }
    }
    u32 ties = s_sel[2];
    bool all_ties = k > 0 && ties == remaining;

    // Gather: everything above the threshold (and all ties when they all fit), plus the raw
    // logits' exp-sum for the log-probability.
    float se = 0.0f;
    for (int i = tid; i < vocab; i += blockDim.x) {
        if (!ids) se += expf(logits[i] - mx);
        if (k == 0) continue;
        float v = scaled[i];
        if (isnan(v)) continue;
        u32 key = order_key(v);
        if (key > prefix || (all_ties && key == prefix)) {
            u32 at = atomicAdd(&s_n, 1u);
            cv[at] = v;
            ci[at] = i;
        }
    }
    se = ids ? se_in : block_sum(se);
    __syncthreads();
    if (k > 0 && !all_ties) {
        // More ties than places (equal logits): the lowest indices win, in index order.
        u32 start = s_n;
        for (int base = 0; base < vocab; base += blockDim.x) {
            int i = base + tid;
            bool tie = false;
            if (i < vocab) {
                float v = scaled[i];
                tie = !isnan(v) && order_key(v) == prefix;
            }
            u32 ballot = __ballot_sync(0xffffffffu, tie);
            if (lane == 0) warp_n[warp] = __popc(ballot);
            __syncthreads();
            u32 before = s_taken;
            for (int w = 0; w < warp; w++) before += warp_n[w];
            before += __popc(ballot & ((1u << lane) - 1u));
            if (tie && before < remaining) {
                cv[start + before] = scaled[i];
                ci[start + before] = i;
            }
            __syncthreads();
            if (tid == 0) {
                u32 all = 0;
                for (int w = 0; w < (int)(blockDim.x >> 5); w++) all += warp_n[w];
                s_taken += all;
            }
            __syncthreads();
            if (s_taken >= remaining) break;
        }
    }
    __syncthreads();

    // The k candidates, heaviest first (the host's sort order), then their weights.
    rank_sort(cv, ci, (int)k, sv, si);
    __syncthreads();
    float best = k > 0 ? sv[0] : 0.0f;
    for (int t = tid; t < (int)k; t += blockDim.x)
        cv[t] = (float)exp((double)__fsub_rn(sv[t], best));
    for (int t = tid; t < (int)k; t += blockDim.x) ci[t] = si[t];
    __syncthreads();
    // The host sorts by weight; equal weights of different logits fall back to index order.
    rank_sort(cv, ci, (int)k, sv, si);
    __syncthreads();

    if (tid == 0) {
        int token = 0;
        if (k > 0) {
            double total = 0.0;
            for (u32 t = 0; t < k; t++) total += (double)sv[t];
            u32 keep = k;
            if (top_p < 1.0f) {
                float floor = (float)__ddiv_rn(__dmul_rn(1.0 - (double)top_p, total), (double)k);
                u32 kept = 0;
                while (kept < k && sv[kept] >= floor) kept++;
                keep = kept;
                double target = __dmul_rn((double)top_p, total), mass = 0.0;
                for (u32 t = 0; t < kept; t++) {
                    mass += (double)sv[t];
                    if (mass >= target) {
                        keep = t + 1;
                        break;
                    }
                }
            }
            if (min_p > 0.0f) {
                u32 n = 0;
                while (n < keep && sv[n] >= min_p) n++;
                keep = n > 0 ? n : 1;
            }
            double sum = 0.0;
            for (u32 t = 0; t < keep; t++) sum += (double)sv[t];
            // _rn: a fused u * sum - w would round differently from the host.
            double target = __dmul_rn(u, sum);
            token = keep > 0 ? si[keep - 1] : 0;
            for (u32 t = 0; t < keep; t++) {
                target = __dsub_rn(target, (double)sv[t]);
                if (target < 0.0) {
                    token = si[t];
                    break;
                }
            }
        }
        if (ids && k > 0) token = ids[token];
        *token_out = token;
        *logprob_out = (logits[token] - mx) - logf(se);
        u32 h = hist[token];
        u32 n = (h & HIST_COUNT) + 1u;
        hist[token] = (h & HIST_SEEN) | (n & HIST_COUNT) | (remember ? HIST_SEEN : 0u);
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_pick(const float* __restrict__ logits, const float* __restrict__ scaled, int vocab,
            int top_k, float top_p, float min_p, double u, int remember, u32* __restrict__ hist,
            int* __restrict__ token_out, float* __restrict__ logprob_out) {
    pick_core(logits, scaled, nullptr, vocab, top_k, top_p, min_p, u, remember, hist, token_out, logprob_out,
              0.0f, 0.0f);
}

// Many blocks for the first pass (one block over 248,320 logits took ≈ 0.45 ms on the H200):
// sample_part: grid SAMPLE_PARTS, block 256; block b takes the contiguous slice b of the
//   vocabulary (at most SAMPLE_PART_CAP values) and keeps its own top k of the scaled values by
//   the same rule (key descending, ties to the lower id) in ascending id order, with its count of
//   valid values, its raw logits' maximum and Σ exp(logit − that maximum). The whole top k is
//   within the union of the blocks' top k's, and the order of the union is the vocabulary's.
// sample_pick_parts: one block: the union, compacted in block order, then sample_pick's steps on
//   it; the log-probability from the partials (log-sum-exp of the blocks').
// cands (u32 words): counts [P], maxima [P], exp-sums [P], values [P][PICK_MAX_K], ids
// [P][PICK_MAX_K], then the compacted values [P · PICK_MAX_K] and ids [P · PICK_MAX_K].
#ifndef SAMPLE_PARTS
#error "SAMPLE_PARTS comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif
#ifndef SAMPLE_PART_CAP
#error "SAMPLE_PART_CAP comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif

extern "C" __global__ void __launch_bounds__(256)
sample_part(const float* __restrict__ logits, const float* __restrict__ scaled, int vocab, int top_k,
            u32* __restrict__ cands) {
    __shared__ u32 keys[SAMPLE_PART_CAP];
    __shared__ u32 bins[256];
    __shared__ u32 s_sel[3], s_valid, s_taken, s_out;
    __shared__ u32 warp_n[8], warp_t[8];
    __shared__ float red[8];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    int P = gridDim.x, b = blockIdx.x;
    int slice = (vocab + P - 1) / P;
    int lo = b * slice, n = max(0, min(vocab, lo + slice) - lo);
    if (tid == 0) {
        s_valid = 0;
        s_taken = 0;
        s_out = 0;
    }
    __syncthreads();
    // Keys (0 for NaN: no float's key is 0 but a NaN's), the valid count and the raw maximum.
    u32 nv = 0;
    float mx = NEG_INF;
    for (int j = tid; j < n; j += blockDim.x) {
        float v = scaled[lo + j];
        bool ok = !isnan(v);
        keys[j] = ok ? order_key(v) : 0u;
        nv += ok ? 1u : 0u;
        mx = fmaxf(mx, logits[lo + j]);
    }
    atomicAdd(&s_valid, nv);
    mx = warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
    for (int w = 1; w < nw; w++) mx = fmaxf(mx, red[w]);
    float se = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) se += expf(logits[lo + j] - mx);
    se = block_sum(se);
    u32 k = min(min((u32)top_k, (u32)PICK_MAX_K), s_valid);

    // Radix select over the slice (sample_pick's, on the keys in shared memory).
    u32 prefix = 0, mask = 0, remaining = k;
    if (k > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int j = tid; j < 256; j += blockDim.x) bins[j] = 0;
            __syncthreads();
            for (int j = tid; j < n; j += blockDim.x) {
                u32 key = keys[j];
                if (key != 0u && (key & mask) == prefix) atomicAdd(&bins[(key >> shift) & 0xffu], 1u);
            }
            __syncthreads();
            radix_narrow(bins, shift, prefix, remaining, mask, s_sel);
        }
    }
    // The block's top k in ascending id order: everything above the threshold, and the first
    // `remaining` ties at it.
    float* out_v = reinterpret_cast<float*>(cands + 3 * P) + (long long)b * PICK_MAX_K;
    int* out_i = reinterpret_cast<int*>(cands + 3 * P + P * PICK_MAX_K) + (long long)b * PICK_MAX_K;
    if (k > 0) {
        for (int base = 0; base < n; base += blockDim.x) {
            int j = base + tid;
            u32 key = j < n ? keys[j] : 0u;
            bool tie = key != 0u && key == prefix;
            bool above = key != 0u && key > prefix;
            u32 tb = __ballot_sync(0xffffffffu, tie);
            if (lane == 0) warp_t[warp] = __popc(tb);
            __syncthreads();
            u32 tie_rank = s_taken + __popc(tb & ((1u << lane) - 1u));
            for (int w = 0; w < warp; w++) tie_rank += warp_t[w];
            bool take = above || (tie && tie_rank < remaining);
            u32 ob = __ballot_sync(0xffffffffu, take);
            if (lane == 0) warp_n[warp] = __popc(ob);
            __syncthreads();
            u32 at = s_out + __popc(ob & ((1u << lane) - 1u));
            for (int w = 0; w < warp; w++) at += warp_n[w];
            if (take) {
                out_v[at] = scaled[lo + j];
                out_i[at] = lo + j;
            }
            __syncthreads();
            if (tid == 0) {
                for (int w = 0; w < nw; w++) {
                    s_taken += warp_t[w];
                    s_out += warp_n[w];
                }
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        cands[b] = k;
        reinterpret_cast<float*>(cands)[P + b] = mx;
        reinterpret_cast<float*>(cands)[2 * P + b] = se;
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_pick_parts(const float* __restrict__ logits, int vocab, int top_k, float top_p, float min_p,
                  double u, int remember, u32* __restrict__ hist, u32* __restrict__ cands, int parts,
                  int* __restrict__ token_out, float* __restrict__ logprob_out) {
    __shared__ int offs[SAMPLE_PARTS + 1];
    __shared__ float s_max[SAMPLE_PARTS], s_sum[SAMPLE_PARTS];
    __shared__ float s_mx, s_se;
    const float* maxes = reinterpret_cast<const float*>(cands) + parts;
    const float* sums = reinterpret_cast<const float*>(cands) + 2 * parts;
    const float* part_v = reinterpret_cast<const float*>(cands + 3 * parts);
    const int* part_i = reinterpret_cast<const int*>(cands + 3 * parts + parts * PICK_MAX_K);
    float* flat_v = reinterpret_cast<float*>(cands + 3 * parts + 2 * parts * PICK_MAX_K);
    int* flat_i = reinterpret_cast<int*>(cands + 3 * parts + 3 * parts * PICK_MAX_K);
    // The parts' counts and partials in parallel (one load each), then the scan in shared memory.
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        offs[p + 1] = (int)cands[p];
        s_max[p] = maxes[p];
        s_sum[p] = sums[p];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int o = 0;
        float mx = NEG_INF;
        for (int p = 0; p < parts; p++) {
            int c = offs[p + 1];
            offs[p] = o;
            o += c;
            mx = fmaxf(mx, s_max[p]);
        }
        offs[parts] = o;
        float se = 0.0f;
        for (int p = 0; p < parts; p++)
            if (s_sum[p] > 0.0f) se += s_sum[p] * expf(s_max[p] - mx);
        s_mx = mx;
        s_se = se;
    }
    __syncthreads();
    int total = offs[parts];
    // Every (part, slot) at once: at most top_k slots a part hold candidates.
    int kk = min(top_k, PICK_MAX_K);
    for (int idx = threadIdx.x; idx < parts * kk; idx += blockDim.x) {
        int p = idx / kk, j = idx % kk;
        if (j < offs[p + 1] - offs[p]) {
            flat_v[offs[p] + j] = part_v[(long long)p * PICK_MAX_K + j];
            flat_i[offs[p] + j] = part_i[(long long)p * PICK_MAX_K + j];
        }
    }
    __syncthreads();
    pick_core(logits, flat_v, flat_i, total, top_k, top_p, min_p, u, remember, hist, token_out, logprob_out,
              s_mx, s_se);
}

// Top log-probabilities on the device (the host's lily_core::logprob, reported with a decode
// step's token): the row's log-sum-exp and its k ≤ LOGPROB_MAX_K best (id, log-probability) pairs,
// most likely first, ties to the lower id (f32::total_cmp order of the logits, as the host sorts).
// A candidate is one u64, (order_key(logit) << 32) | ~id: the larger u64 is the better candidate,
// so every selection is a max, and round r takes the largest candidate below round r − 1's.
// logprob_part: grid ARGMAX_BLOCKS, block 256; block b takes a contiguous slice of the vocabulary
//   and writes parts[b] = (its largest logit, Σ exp(logit − that), its k best candidates; 0 where
//   the slice has fewer).
// logprob_final: one block of 256 threads: the log-sum-exp of the blocks' partials (in f64), the
//   k best of the ARGMAX_BLOCKS · k candidates (held in shared memory, 20 KB at k = 20),
//   out[2i] = id, out[2i + 1] = logprob bits; an id of 0xffffffff where there are fewer than k.
// Bytes: logits [V] read once (the rounds re-read the block's slice from L1).
#ifndef LOGPROB_MAX_K
#error "LOGPROB_MAX_K comes from the launcher module (crates/lily-cuda/src/kernels/sample.rs)"
#endif
#define LOGPROB_PART_WORDS (2 + 2 * LOGPROB_MAX_K)

__device__ __forceinline__ u64 lp_cand(float v, int i) {
    return ((u64)order_key(v) << 32) | (u64)(~(u32)i);
}

// The block's largest of `c` (every thread gets it); red: 32 u64 of shared memory.
__device__ __forceinline__ u64 block_max_u64(u64 c, u64* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 d = __shfl_xor_sync(0xffffffffu, c, o);
        c = d > c ? d : c;
    }
    __syncthreads();
    if (lane == 0) red[warp] = c;
    __syncthreads();
    c = 0;
    for (int w = 0; w < nw; w++) c = red[w] > c ? red[w] : c;
    return c;
}

extern "C" __global__ void __launch_bounds__(256)
logprob_part(const float* __restrict__ logits, int vocab, int k, u32* __restrict__ parts) {
    __shared__ u64 red[32];
    __shared__ float mx_s[32];
    int per = (vocab + gridDim.x - 1) / gridDim.x;
    int lo = blockIdx.x * per, hi = min(vocab, lo + per);
    float mx = NEG_INF;
    u64 best = 0;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = logits[i];
        mx = fmaxf(mx, v);
        u64 c = lp_cand(v, i);
        best = c > best ? c : best;
    }
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) mx_s[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) mx = fmaxf(mx, mx_s[w]);
    float s = 0.0f;
    if (mx != NEG_INF)
        for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) s += expf(logits[i] - mx);
    s = block_sum(s);
    u32* out = parts + (long long)blockIdx.x * LOGPROB_PART_WORDS;
    if (threadIdx.x == 0) {
        out[0] = __float_as_uint(mx);
        out[1] = __float_as_uint(s);
    }
    // Round r: the largest candidate below the last one taken. A thread's own best is recomputed
    // only when it was the one taken.
    u64 last = ~0ull;
    for (int r = 0; r < k; r++) {
        u64 top = block_max_u64(best, red);
        if (threadIdx.x == 0) {
            out[2 + 2 * r] = (u32)(top >> 32);
            out[3 + 2 * r] = (u32)top;
        }
        last = top;
        if (top != 0 && best == top) {
            best = 0;
            for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
                u64 c = lp_cand(logits[i], i);
                if (c < last && c > best) best = c;
            }
        }
    }
}

__device__ __forceinline__ float key_value(u32 key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

extern "C" __global__ void __launch_bounds__(256)
logprob_final(const u32* __restrict__ parts, int n_parts, int k, u32* __restrict__ out) {
    __shared__ u64 cand[ARGMAX_BLOCKS * LOGPROB_MAX_K];
    __shared__ u64 red[32];
    __shared__ float mx_s[32];
    __shared__ double s_logz;
    int t = threadIdx.x;
    // M = the largest of the blocks' maxima; Σ_b sum_b · exp(max_b − M), in f64.
    float m = NEG_INF;
    for (int p = t; p < n_parts; p += blockDim.x)
        m = fmaxf(m, __uint_as_float(parts[(long long)p * LOGPROB_PART_WORDS]));
    m = warp_max(m);
    if ((t & 31) == 0) mx_s[t >> 5] = m;
    __syncthreads();
    m = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, mx_s[w]);
    if (t == 0) {
        double s = 0.0;
        for (int p = 0; p < n_parts; p++) {
            float mp = __uint_as_float(parts[(long long)p * LOGPROB_PART_WORDS]);
            float sp = __uint_as_float(parts[(long long)p * LOGPROB_PART_WORDS + 1]);
            if (sp > 0.0f) s += (double)sp * exp((double)mp - (double)m);
        }
        s_logz = (double)m + log(s);
    }
    // The candidates into shared memory (the rounds re-read them), each thread's best among its
    // slots; the rounds as in logprob_part.
    int slots = min(n_parts, ARGMAX_BLOCKS) * k;
    u64 best = 0;
    for (int j = t; j < slots; j += blockDim.x) {
        const u32* c = parts + (long long)(j / k) * LOGPROB_PART_WORDS + 2 + 2 * (j % k);
        u64 v = ((u64)c[0] << 32) | c[1];
        cand[j] = v;
        best = v > best ? v : best;
    }
    __syncthreads();
    double logz = s_logz;
    u64 last = ~0ull;
    for (int r = 0; r < k; r++) {
        u64 top = block_max_u64(best, red);
        if (t == 0) {
            if (top == 0) {
                out[2 * r] = 0xffffffffu;
                out[2 * r + 1] = __float_as_uint(NEG_INF);
            } else {
                out[2 * r] = ~(u32)top;
                out[2 * r + 1] = __float_as_uint((float)((double)key_value((u32)(top >> 32)) - logz));
            }
        }
        last = top;
        if (top != 0 && best == top) {
            best = 0;
            for (int j = t; j < slots; j += blockDim.x) {
                u64 v = cand[j];
                if (v < last && v > best) best = v;
            }
        }
    }
}
