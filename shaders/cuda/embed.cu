// Token embedding (MODEL.md §2.1): x[t, :] = E[tokens[t], :], dequantised from the checkpoint's
// packed rows. Token ids come from device memory (the sampler writes the next one there), so a
// decode step needs no host round trip. Bytes: one row per token. One block per token.

__device__ __forceinline__ void embed_row(const QWeight& w, long long row, float* __restrict__ x, int t) {
    int wpr = qw_words_per_row(w);
    float vals[8];
    for (int wi = threadIdx.x; wi < wpr; wi += blockDim.x) {
        int per = qw_unpack(w, row, wi, vals);
        for (int j = 0; j < per; j++) x[(long long)t * w.cols + wi * per + j] = act(vals[j]);
    }
}

extern "C" __global__ void embed(QWeight w, const int* __restrict__ tokens, float* __restrict__ x, int n_tok) {
    pdl_wait();
    int t = blockIdx.x;
    if (t >= n_tok) return;
    embed_row(w, tokens[t], x, t);
}

// embed_rows: a batched decode step's tokens, row t of x from the token at tokens[t] (a table of
// each sequence's next-token pointers). grid rows, block 128.
extern "C" __global__ void embed_rows(QWeight w, const int* const* __restrict__ tokens, float* __restrict__ x) {
    pdl_wait();
    int t = blockIdx.x;
    embed_row(w, *tokens[t], x, t);
}
