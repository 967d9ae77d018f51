// A CUDA transcription (by hand, session 24, branch s24win; shaders/wgsl/linear_q4_rows.wgsl is
// the reference) of linear_q4_rows' persistent loop as the 16-row kernel runs it on decode's
// in_proj and q/k/v (RB 16, RI 4, EARLY 1, the norm folded, 4-bit; `two` from the columns at run
// time), for the registers ptxas gives each form (scripts/nvrtc_regs.py):
//   k_s20     session 20 (082a104): a two-word row's second words read in their round (`c2`);
//   k_today   since session 21 (62d1d17): the next round's second words carried (`cur2`, `nxt2`);
//   k_oneword `WORDS` 1 (`rows_one_word`): `two` false at compile time.
// Not run anywhere: only compiled.
#define RB 16
#define RI 4
struct Words { uint4 w[RI]; float s[RI]; float b[RI]; };
struct P { unsigned rows, cols, scale_off, bias_off, x_off, y_off, norm; float eps; unsigned nblocks_unused; };

__device__ __forceinline__ float bf(const unsigned* W, unsigned i) {
  unsigned v = W[i >> 1]; v = (i & 1) ? (v & 0xffff0000u) : (v << 16); return __uint_as_float(v);
}
__device__ __forceinline__ Words read_words(const uint4* W, const unsigned* Wh, const P& p,
    unsigned r0, unsigned rr, unsigned nr, unsigned q, unsigned g, unsigned quads, unsigned groups) {
  Words o;
#pragma unroll
  for (int j = 0; j < RI; j++) {
    unsigned row = (rr + j < nr) ? r0 + rr + j : r0;
    o.w[j] = W[row * quads + q];
    o.s[j] = bf(Wh, p.scale_off + row * groups + g);
    o.b[j] = bf(Wh, p.bias_off + row * groups + g);
  }
  return o;
}
__device__ __forceinline__ float qd(uint4 w, const float4* x) {
  unsigned u[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < 4; k++) {
#pragma unroll
    for (int n = 0; n < 2; n++) {
      float4 xv = x[k * 2 + n];
      unsigned v = u[k] >> (16 * n);
      s += float(v & 15u) * xv.x + float((v >> 4) & 15u) * xv.y + float((v >> 8) & 15u) * xv.z + float((v >> 12) & 15u) * xv.w;
    }
  }
  return s;
}
__device__ __forceinline__ float xsum(const float4* x) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; i++) s += x[i].x + x[i].y + x[i].z + x[i].w;
  return s;
}
__shared__ float part[RB * 64];
__device__ __forceinline__ void row_put(unsigned lid, unsigned r, float v) { part[r * 64 + lid] = v; }
__device__ __forceinline__ float row_total(unsigned lid) {
  __syncthreads();
  unsigned r = lid / (64 / RB), k = lid % (64 / RB);
  float s = 0.f;
  for (unsigned i = k; i < 64; i += 64 / RB) s += part[r * 64 + i];
  s += __shfl_down_sync(0xffffffffu, s, 2); s += __shfl_down_sync(0xffffffffu, s, 1);
  __syncthreads();
  return s;
}
__device__ __forceinline__ float rms(unsigned lid, float ss, unsigned cols, float eps) {
  __shared__ float red[64]; red[lid] = ss; __syncthreads();
  float t = 0.f; for (int i = 0; i < 64; i++) t += red[i]; __syncthreads();
  return rsqrtf(t / cols + eps);
}

template <int MODE>
__device__ void body(const P p, const uint4* __restrict__ W, const unsigned* __restrict__ Wh,
    const float4* __restrict__ X, float* __restrict__ Y, const float4* __restrict__ Wn) {
  unsigned lid = threadIdx.x, block = blockIdx.x, stride = gridDim.x;
  unsigned r0 = block * RB;
  if (r0 >= p.rows) return;
  unsigned quads = p.cols / 32;
  bool two = MODE == 2 ? false : quads > 64;
  unsigned groups = p.cols / 64, ga = (lid * 32) / 64, gc = ((lid + 64) * 32) / 64;
  unsigned nr = min(RB, p.rows - r0);
  Words cur = read_words(W, Wh, p, r0, 0, nr, lid, ga, quads, groups);
  Words cur2 = {};
  if (MODE == 1 && two) cur2 = read_words(W, Wh, p, r0, 0, nr, lid + 64, gc, quads, groups);
  float4 xa[8], xc[8];
#pragma unroll
  for (int i = 0; i < 8; i++) { xa[i] = X[p.x_off + lid * 8 + i]; xc[i] = make_float4(0, 0, 0, 0); }
  if (two) {
#pragma unroll
    for (int i = 0; i < 8; i++) xc[i] = X[p.x_off + (lid + 64) * 8 + i];
  }
  float ss = 0.f;
  if (p.norm) {
    float4 wa[8], wc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) { wa[i] = Wn[lid * 8 + i]; wc[i] = make_float4(1, 1, 1, 1); }
    if (two) {
#pragma unroll
      for (int i = 0; i < 8; i++) wc[i] = Wn[(lid + 64) * 8 + i];
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
      ss += xa[i].x * xa[i].x + xa[i].y * xa[i].y + xa[i].z * xa[i].z + xa[i].w * xa[i].w
          + xc[i].x * xc[i].x + xc[i].y * xc[i].y + xc[i].z * xc[i].z + xc[i].w * xc[i].w;
      xa[i] = make_float4(xa[i].x * wa[i].x, xa[i].y * wa[i].y, xa[i].z * wa[i].z, xa[i].w * wa[i].w);
      xc[i] = make_float4(xc[i].x * wc[i].x, xc[i].y * wc[i].y, xc[i].z * wc[i].z, xc[i].w * wc[i].w);
    }
  }
  float sa = xsum(xa), sc = xsum(xc);
  unsigned nblocks = (p.rows + RB - 1) / RB;
  unsigned b = block, rr = 0, c0 = r0, cn = nr;
  float rn = 1.f; bool first = true;
  for (;;) {
    unsigned nb = b, nrr = rr + RI;
    if (nrr >= RB) { nb = b + stride; nrr = 0; }
    bool more = nb < nblocks;
    Words nxt = {}, nxt2 = {};
    if (more) {
      unsigned n0 = nb * RB, nn = min(RB, p.rows - n0);
      nxt = read_words(W, Wh, p, n0, nrr, nn, lid, ga, quads, groups);
      if (MODE == 1 && two) nxt2 = read_words(W, Wh, p, n0, nrr, nn, lid + 64, gc, quads, groups);
    }
    float pa[RI];
#pragma unroll
    for (int j = 0; j < RI; j++) pa[j] = cur.s[j] * qd(cur.w[j], xa) + cur.b[j] * sa;
    if (two) {
      Words c2 = MODE == 1 ? cur2 : read_words(W, Wh, p, c0, rr, cn, lid + 64, gc, quads, groups);
#pragma unroll
      for (int j = 0; j < RI; j++) pa[j] += c2.s[j] * qd(c2.w[j], xc) + c2.b[j] * sc;
    }
#pragma unroll
    for (int j = 0; j < RI; j++) row_put(lid, rr + j, pa[j]);
    if (rr + RI >= RB) {
      if (first && p.norm) rn = rms(lid, ss, p.cols, p.eps);
      first = false;
      float t = row_total(lid) * rn;
      unsigned r = lid / (64 / RB);
      if (lid % (64 / RB) == 0 && r < cn) Y[p.y_off + c0 + r] = t;
      __syncthreads();
    }
    if (!more) break;
    b = nb; rr = nrr; c0 = nb * RB; cn = min(RB, p.rows - c0);
    cur = nxt;
    if (MODE == 1) cur2 = nxt2;
  }
}
extern "C" __global__ void __launch_bounds__(64) k_s20(const P p, const uint4* W, const unsigned* Wh, const float4* X, float* Y, const float4* Wn) { body<0>(p, W, Wh, X, Y, Wn); }
extern "C" __global__ void __launch_bounds__(64) k_today(const P p, const uint4* W, const unsigned* Wh, const float4* X, float* Y, const float4* Wn) { body<1>(p, W, Wh, X, Y, Wn); }
extern "C" __global__ void __launch_bounds__(64) k_oneword(const P p, const uint4* W, const unsigned* Wh, const float4* X, float* Y, const float4* Wn) { body<2>(p, W, Wh, X, Y, Wn); }
