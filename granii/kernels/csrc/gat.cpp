// GAT attention fused with its aggregation, and the edge-wise kernels it is made of (SDDMM add,
// edge softmax), on the CSR of A (one row per destination, columns = sources, plus the edge id of
// each entry so that edge tensors stay in the graph's edge-id order).
//
//   granii::gat_forward(indptr, indices, eids, el, er, feat, w, slope, bias=None) -> [out, m, 1/S]
//   granii::gat_backward(in_indptr, t2in, t_indptr, t_indices, t_eids, el, er, feat, w, slope,
//                        m, 1/S, out, dout, need_el, need_er, need_feat, need_w, bias=None)
//       -> [del, der, dfeat, dw] (empty tensors where not needed)
//   granii::sddmm_add_coo(src, dst, a, b), edge_row_sum(indptr, eids, x),
//   granii::edge_softmax_csr(indptr, eids, x), edge_softmax_csr_backward(indptr, eids, a, g)
//
// Fused forward, per destination v and head h, over the in-edges e = (u -> v):
//   x_e = el[u,h] + er[v,h],  z_e = leaky_relu(x_e),  m_v = max_e z_e,  S_v = sum_e exp(z_e - m_v)
//   out[v,h,:] = sum_e (exp(z_e - m_v) / S_v) * w_e * feat[u,h,:]  [+ bias[h,:]]
// Per row, the coefficients of all its entries and heads go to a scratch buffer (heads in one
// vector when H is 4, 8 or 16), then the source rows are gathered in register tiles. Scores are
// never stored beyond the row; m_v and 1/S_v are kept for the backward, which recomputes
// a_e = exp(z_e - m_v) / S_v instead of storing an edge x head matrix, and walks A^T so the
// source-side sums need no atomics. Rows are split between threads by rows + edges; a row is
// never split, so one row holding most edges runs on one thread.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "native.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace granii {
namespace {

// exp(x) in float: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes'
// coefficients, about 2 ulp), 2^n from the exponent bits. Branch-free so loops over it vectorise.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
inline double exp_approx(double x) { return std::exp(x); }

// The edge id of CSR entry j: eids[j], or j itself when the edges are stored in CSR order.
template <typename I>
inline int64_t edge_id(const I* eids, int64_t j) { return eids ? static_cast<int64_t>(eids[j]) : j; }

// Branch-free (max and min, no compare-and-jump): the sign of a score is random, so a branch
// mispredicts on about half the edges (one head, F = 32: the score pass took 1.6x longer).
template <typename T>
inline T leaky(T x, T slope) { return std::max(x, T(0)) + slope * std::min(x, T(0)); }

// Row cut points for `parts` threads so that each range holds about the same rows + edges (the
// cost of a row is its edges plus a constant): skewed degrees do not leave a thread idle.
template <typename I>
std::vector<int64_t> balanced_cuts(const I* indptr, int64_t rows, int parts) {
  std::vector<int64_t> cut(parts + 1, rows);
  cut[0] = 0;
  const int64_t base = indptr[0];
  const int64_t total = rows + (indptr[rows] - base);
  for (int p = 1; p < parts; ++p) {
    const int64_t target = total * p / parts;
    int64_t lo = 0, hi = rows;
    while (lo < hi) {  // smallest r with (edges before r) + r >= target
      const int64_t mid = (lo + hi) / 2;
      if (static_cast<int64_t>(indptr[mid]) - base + mid < target) lo = mid + 1; else hi = mid;
    }
    cut[p] = lo;
  }
  return cut;
}

// Work a pass spends per edge besides its heads x features (the score, its exponential, the
// row's two sweeps): one thread ran Cora's 13 k edges at 8 features in 83 us, at 32 in 91 us.
constexpr int64_t kEdgeWork = 32;

// fn(row_begin, row_end) over all rows, one balanced range per thread of torch's pool; on the
// calling thread when `work` plus kEdgeWork per edge is below serial_work().
template <typename I, typename Fn>
void parallel_rows(const I* indptr, int64_t rows, int64_t work, const Fn& fn) {
  const int parts = at::get_num_threads();
  const int64_t edges = rows > 0 ? static_cast<int64_t>(indptr[rows] - indptr[0]) : 0;
  if (parts <= 1 || rows < 2 || work + kEdgeWork * edges < serial_work() ||
      at::in_parallel_region()) {
    fn(int64_t(0), rows);
    return;
  }
  const auto cut = balanced_cuts(indptr, rows, parts);
  at::parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) fn(cut[p], cut[p + 1]);
  });
}

template <typename T, typename I>
struct Gat {
  const I* indptr;   // (rows + 1,)
  const I* indices;  // (nnz,) column of each entry
  const I* eids;     // (nnz,) edge id of each entry; nullptr: entry j is edge j
  const T* el;       // (num_src, H)
  const T* er;       // (num_dst, H)
  const T* feat;     // (num_src, H, F)
  const T* w;        // (E,) or (E, H), or nullptr
  T slope;
  int64_t H, F;
  int64_t wh;        // weights per edge: 1, or H (one per edge and head)
};

// Weight of edge e for head h: w_e, or w_eh with one weight per edge and head; 1 without weights.
template <typename T, typename I>
inline T weight_at(const Gat<T, I>& g, int64_t e, int64_t h) {
  return g.w ? g.w[g.wh > 1 ? e * g.wh + h : e] : T(1);
}

// Software prefetch. Rows are gathered at random, so without requests ahead of use every row's
// first lines stall the loop (measured: the score pass on pubmed ran 1.9x faster with them).
// kAhead: entries ahead whose per-node score inputs (el rows; er, m, 1/S, D rows in the backward)
// are requested while the current entry is scored. kEarlyRowBytes: the first bytes of each
// source's feature row (dout row in the backward) requested while the row is scored, so the first
// tile walk finds them; each walk then requests the next tile (gather_tile).
#ifndef GRANII_GAT_AHEAD
#define GRANII_GAT_AHEAD 16
#endif
constexpr int64_t kAhead = GRANII_GAT_AHEAD;
#ifndef GRANII_GAT_EARLY
#define GRANII_GAT_EARLY 1024
#endif
constexpr int64_t kEarlyRowBytes = GRANII_GAT_EARLY;

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off);
}

// o[0:F] += c * x[0:F]
template <int FC, typename T>
inline void axpy(T* __restrict o, const T* __restrict x, T c, int64_t Fr) {
  const int64_t F = FC > 0 ? FC : Fr;
  for (int64_t f = 0; f < F; ++f) o[f] += c * x[f];
}

// GCC/Clang vector types of L lanes (mapped onto SSE, AVX2 or AVX-512, as -march allows): the
// accumulators of a tile stay in registers.
template <typename T, int L>
struct VecT;
#define GRANII_GAT_VEC(T, L) \
  template <>                \
  struct VecT<T, L> {        \
    typedef T type __attribute__((vector_size(sizeof(T) * L), aligned(sizeof(T)), may_alias)); \
  };
GRANII_GAT_VEC(float, 16)
GRANII_GAT_VEC(float, 8)
GRANII_GAT_VEC(float, 4)
GRANII_GAT_VEC(float, 1)
GRANII_GAT_VEC(double, 8)
GRANII_GAT_VEC(double, 4)
GRANII_GAT_VEC(double, 2)
#undef GRANII_GAT_VEC

// exp_approx on a whole vector of floats (the same steps, lane by lane).
template <typename V>
inline V exp_vec(V x) {
  typedef int32_t IV __attribute__((vector_size(sizeof(V))));
  x = x < -87.0f ? V{} - 87.0f : x;
  x = x > 88.0f ? V{} + 88.0f : x;
  const V t = x * 1.44269504088896341f;
  const V n = (t + 12582912.0f) - 12582912.0f;
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const IV bits = (__builtin_convertvector(n, IV) + 127) << 23;
  return p * reinterpret_cast<V>(bits);  // the same bits as floats, in registers
}

// Bytes of one vector register (see spmm.cpp): 64 with AVX-512, else 32.
#if defined(__AVX512F__)
constexpr int kGatVecBytes = 64;
#else
constexpr int kGatVecBytes = 32;
#endif

// Lanes per vector for rows of FC features per head: one register, or FC if smaller (then
// each vector is one head); 0 when FC is not a compile-time multiple of 16 bytes.
template <typename T, int FC>
constexpr int lanes_for() {
  constexpr int full = kGatVecBytes / static_cast<int>(sizeof(T));
  constexpr int l = FC < full ? FC : full;
  return (FC > 0 && l * static_cast<int>(sizeof(T)) >= 16 && FC % l == 0) ? l : 0;
}

// Bytes of features per tile walk (accumulators in registers). Measured on 4 heads x 256 (one
// thread): 256 and 128 bytes about 14% faster than 512 with the next tile requested during each
// walk, 1024 slower.
#ifndef GRANII_GAT_TILE_BYTES
#define GRANII_GAT_TILE_BYTES 256
#endif

// o[t0 : t0 + NV L] = sum_j coef[j, head] * feat[cols[j], t0 : t0 + NV L] for the deg entries of
// one row; the head of each vector is its feature offset / F. While walking, the same entries'
// next tile (at `next`, if any) is requested, so each walk prepares the following one.
template <int NV, int L, typename T, typename I>
inline void gather_tile(const T* __restrict feat, const I* __restrict cols, const T* __restrict coef,
                        int64_t deg, int64_t H, int64_t HF, int64_t F, int64_t t0, int64_t next, T* __restrict o) {
  using vec = typename VecT<T, L>::type;
  constexpr int kBytes = NV * L * static_cast<int>(sizeof(T));
  vec acc[NV];
  int64_t hv[NV];
  for (int i = 0; i < NV; ++i) {
    acc[i] = vec{};
    hv[i] = (t0 + i * L) / F;
  }
  for (int64_t j = 0; j < deg; ++j) {
    const T* row = feat + static_cast<int64_t>(cols[j]) * HF;
    if (next >= 0) {
      const char* xp = reinterpret_cast<const char*>(row + next);
      for (int bb = 0; bb < kBytes; bb += 64) __builtin_prefetch(xp + bb);
    }
    const vec* x = reinterpret_cast<const vec*>(row + t0);
    const T* cj = coef + j * H;
    for (int i = 0; i < NV; ++i) acc[i] += cj[hv[i]] * x[i];
  }
  vec* out = reinterpret_cast<vec*>(o + t0);
  for (int i = 0; i < NV; ++i) out[i] = acc[i];
}

// out row o (H F) = sum_j coef[j, h] feat[cols[j], h, :], tiled over the row so each tile's
// accumulators stay in registers while the row's entries are walked once per tile.
template <int FC, typename T, typename I>
inline void gather_row(const T* feat, const I* cols, const T* coef, int64_t deg, int64_t H, int64_t Fr, T* o) {
  constexpr int L = lanes_for<T, FC>();
  const int64_t F = FC > 0 ? FC : Fr, HF = H * F;
  if constexpr (L > 0) {
    constexpr int NV = GRANII_GAT_TILE_BYTES / (L * static_cast<int>(sizeof(T))) > 0
                           ? GRANII_GAT_TILE_BYTES / (L * static_cast<int>(sizeof(T))) : 1;
    // tiles of NV vectors, then the rest (HF is a multiple of L) in halving tiles, so a short
    // row is still one walk
    auto nx = [&](int64_t t) { return t < HF ? t : int64_t(-1); };
    int64_t t0 = 0;
    for (; t0 + NV * L <= HF; t0 += NV * L) gather_tile<NV, L>(feat, cols, coef, deg, H, HF, F, t0, nx(t0 + NV * L), o);
    if constexpr (NV > 8) if (HF - t0 >= 8 * L) { gather_tile<8, L>(feat, cols, coef, deg, H, HF, F, t0, nx(t0 + 8 * L), o); t0 += 8 * L; }
    if constexpr (NV > 4) if (HF - t0 >= 4 * L) { gather_tile<4, L>(feat, cols, coef, deg, H, HF, F, t0, nx(t0 + 4 * L), o); t0 += 4 * L; }
    if constexpr (NV > 2) if (HF - t0 >= 2 * L) { gather_tile<2, L>(feat, cols, coef, deg, H, HF, F, t0, nx(t0 + 2 * L), o); t0 += 2 * L; }
    if constexpr (NV > 1) if (HF - t0 >= L) { gather_tile<1, L>(feat, cols, coef, deg, H, HF, F, t0, nx(t0 + L), o); t0 += L; }
  } else {
    std::fill(o, o + HF, T(0));
    for (int64_t j = 0; j < deg; ++j) {
      const T* x = feat + static_cast<int64_t>(cols[j]) * HF;
      for (int64_t h = 0; h < H; ++h) axpy<FC>(o + h * F, x + h * F, coef[j * H + h], F);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.
//
// Coefficients of one destination row v (entries b .. b + deg of the CSR) into S (deg, H):
// S[j, h] = exp(z_jh - m_h) / sum_j' exp(z_j'h - m_h) * w_j, and m_h, 1 / sum into mxv, invv.
// HC is the head count when it is a compile-time constant (the per-head state lives in
// registers), else 0. Also requests the el rows of entries kAhead ahead (up to `last`) and, when
// `early`, the feature rows of this row's sources for the aggregation that follows.
template <int HC, typename T, typename I>
void row_coefficients(const Gat<T, I>& g, int64_t v, int64_t b, int64_t deg, int64_t last, int64_t early,
                      T* __restrict S, T* __restrict mxv, T* __restrict invv) {
  const int64_t H = HC > 0 ? HC : g.H, HF = H * g.F;
  const I* __restrict indices = g.indices;
  const T slope = g.slope;
  T mloc[HC > 0 ? HC : 1], sloc[HC > 0 ? HC : 1];
  T* __restrict mm = HC > 0 ? mloc : mxv;
  T* __restrict ss = HC > 0 ? sloc : invv;
  const T* __restrict erv = g.er + v * H;
  for (int64_t h = 0; h < H; ++h) mm[h] = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < deg; ++j) {
    if (b + j + kAhead < last) __builtin_prefetch(g.el + static_cast<int64_t>(indices[b + j + kAhead]) * H);
    prefetch_row(g.feat + static_cast<int64_t>(indices[b + j]) * HF, early);
    const T* __restrict elu = g.el + static_cast<int64_t>(indices[b + j]) * H;
    T* __restrict sj = S + j * H;
    for (int64_t h = 0; h < H; ++h) {
      const T z = leaky(elu[h] + erv[h], slope);
      sj[h] = z;
      mm[h] = std::max(mm[h], z);
    }
  }
  for (int64_t h = 0; h < H; ++h) ss[h] = T(0);
  for (int64_t j = 0; j < deg; ++j) {
    T* __restrict sj = S + j * H;
    for (int64_t h = 0; h < H; ++h) {
      const T p = exp_approx(sj[h] - mm[h]);
      sj[h] = p;
      ss[h] += p;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    const T r = T(1) / ss[h];
    mxv[h] = mm[h];
    invv[h] = r;
  }
  for (int64_t j = 0; j < deg; ++j) {
    const int64_t e = edge_id(g.eids, b + j);
    T* __restrict sj = S + j * H;
    for (int64_t h = 0; h < H; ++h) sj[h] *= invv[h] * weight_at(g, e, h);
  }
}

// The HC head weights of edge e as one vector.
template <int HC, typename I>
inline typename VecT<float, HC>::type weight_vec(const Gat<float, I>& g, int64_t e) {
  using V = typename VecT<float, HC>::type;
  if (!g.w) return V{} + 1.0f;
  if (g.wh > 1) return *reinterpret_cast<const V*>(g.w + e * HC);
  return V{} + g.w[e];
}

// row_coefficients with the HC heads of an entry in one float vector of HC lanes.
template <int HC, typename I>
void row_coefficients_vec(const Gat<float, I>& g, int64_t v, int64_t b, int64_t deg, int64_t last, int64_t early,
                          float* __restrict S, float* __restrict mxv, float* __restrict invv) {
  using V = typename VecT<float, HC>::type;
  const int64_t HF = HC * g.F;
  const I* __restrict indices = g.indices;
  const float slope = g.slope;
  const V erv = *reinterpret_cast<const V*>(g.er + v * HC);
  V m = V{} - std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < deg; ++j) {
    if (b + j + kAhead < last) __builtin_prefetch(g.el + static_cast<int64_t>(indices[b + j + kAhead]) * HC);
    prefetch_row(g.feat + static_cast<int64_t>(indices[b + j]) * HF, early);
    V z = *reinterpret_cast<const V*>(g.el + static_cast<int64_t>(indices[b + j]) * HC) + erv;
    z = z > 0.0f ? z : z * slope;
    *reinterpret_cast<V*>(S + j * HC) = z;
    m = z > m ? z : m;
  }
  V sum = V{};
  for (int64_t j = 0; j < deg; ++j) {
    V* sj = reinterpret_cast<V*>(S + j * HC);
    const V p = exp_vec(*sj - m);
    *sj = p;
    sum += p;
  }
  const V r = 1.0f / sum;
  *reinterpret_cast<V*>(mxv) = m;
  *reinterpret_cast<V*>(invv) = r;
  for (int64_t j = 0; j < deg; ++j) {
    const V wv = weight_vec<HC>(g, edge_id(g.eids, b + j));
    V* sj = reinterpret_cast<V*>(S + j * HC);
    *sj *= r * wv;
  }
}

// S[j] = exp(S[j] - m) for j < n, a vector of entries at a time; returns their sum.
inline float exp_shift_sum(float* __restrict S, int64_t n, float m) {
  constexpr int L = kGatVecBytes / static_cast<int>(sizeof(float));
  using V = typename VecT<float, L>::type;
  V vsum = V{};
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    V* x = reinterpret_cast<V*>(S + j);
    *x = exp_vec(*x - m);
    vsum += *x;
  }
  float sum = 0.0f;
  for (int l = 0; l < L; ++l) sum += vsum[l];
  for (; j < n; ++j) {
    S[j] = exp_approx(S[j] - m);
    sum += S[j];
  }
  return sum;
}

// row_coefficients for one head in float: the entries' scores are contiguous in S, so the exp
// and scaling passes run kGatVecBytes / 4 entries per vector instead of one at a time (with one
// head, scalar exp made the score passes cost more than the aggregation at F = 32).
template <typename I>
void row_coefficients_one(const Gat<float, I>& g, int64_t v, int64_t b, int64_t deg, int64_t last,
                          int64_t early, float* __restrict S, float* __restrict mxv, float* __restrict invv) {
  const int64_t F = g.F;
  const I* __restrict indices = g.indices;
  const float slope = g.slope, erv = g.er[v];
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < deg; ++j) {
    if (b + j + kAhead < last) __builtin_prefetch(g.el + static_cast<int64_t>(indices[b + j + kAhead]));
    prefetch_row(g.feat + static_cast<int64_t>(indices[b + j]) * F, early);
    const float z = leaky(g.el[indices[b + j]] + erv, slope);
    S[j] = z;
    m = std::max(m, z);
  }
  const float r = 1.0f / exp_shift_sum(S, deg, m);
  *mxv = m;
  *invv = r;
  if (g.w) {
    for (int64_t k = 0; k < deg; ++k) S[k] *= r * g.w[edge_id(g.eids, b + k)];
  } else {
    for (int64_t k = 0; k < deg; ++k) S[k] *= r;
  }
}

template <typename T, typename I>
using CoefFn = void (*)(const Gat<T, I>&, int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*, T*);

template <typename T, typename I>
CoefFn<T, I> coefficients_for(int64_t H) {
  if constexpr (std::is_same<T, float>::value) {
    switch (H) {
      case 1: return &row_coefficients_one<I>;
      case 4: return &row_coefficients_vec<4, I>;
      case 8: return &row_coefficients_vec<8, I>;
      case 16: return &row_coefficients_vec<16, I>;
      default: break;
    }
  }
  return &row_coefficients<0, T, I>;
}

// Destination rows [r0, r1): out (rows, H, F), the row max m and 1 / S (rows, H). Per row, the
// coefficients of all its entries and heads into scratch, then one walk (per tile) over the
// source feature rows.
template <int FC, typename T, typename I>
void forward_rows(const Gat<T, I>& g, const T* bias, T* out, T* mx, T* inv, int64_t r0, int64_t r1) {
  const int64_t H = g.H, F = FC > 0 ? FC : g.F, HF = H * F;
  const int64_t last = g.indptr[r1];
  // short feature rows are requested while the scores are computed, long ones by the tile walk
  const int64_t early = std::min<int64_t>(HF, kEarlyRowBytes / static_cast<int64_t>(sizeof(T)));
  const CoefFn<T, I> coefficients = coefficients_for<T, I>(H);
  std::vector<T> sc;
  for (int64_t v = r0; v < r1; ++v) {
    const int64_t b = g.indptr[v], deg = g.indptr[v + 1] - b;
    T* o = out + v * HF;
    if (deg == 0) {
      if (bias) std::copy(bias, bias + HF, o);
      else std::fill(o, o + HF, T(0));
      std::fill(mx + v * H, mx + v * H + H, T(0));
      std::fill(inv + v * H, inv + v * H + H, T(0));
      continue;
    }
    if (static_cast<int64_t>(sc.size()) < deg * H) sc.resize(deg * H);
    coefficients(g, v, b, deg, last, early, sc.data(), mx + v * H, inv + v * H);
    gather_row<FC>(g.feat, g.indices + b, sc.data(), deg, H, F, o);
    if (bias) {
#pragma omp simd
      for (int64_t f = 0; f < HF; ++f) o[f] += bias[f];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, over source rows of A^T (g.indptr/indices/eids are the transpose: rows = sources,
// columns = destinations), so every source-side gradient is summed by one thread. For an edge
// e = (u -> v) and head h, with a_e recomputed from m_v and 1/S_v:
//   d_e   = <dout[v,h], feat[u,h]>,   D_v = <dout[v,h], out[v,h]> (= sum_e a_e w_e d_e)
//   dfeat[u,h] = sum_e a_e w_e dout[v,h]
//   dx_e  = a_e (w_e d_e - D_v) leaky'(x_e),   del[u,h] = sum_e dx_e,   dw_e = sum_h a_e d_e
// (with one weight per edge and head, w_eh in place of w_e and dw_eh = a_eh d_eh)
// dx_e goes to gx (E, H) at the edge's position in the CSR of A (t2in maps each entry of A^T to
// it), so the destination-side sums der[v,h] = sum_e dx_e read contiguous rows.
template <typename T, typename I>
struct Grads {
  const T* dout;  // (num_dst, H, F)
  const T* rowv;  // (num_dst, 4, H): er, m, 1/S, D of each destination, side by side
  T* dfeat;       // (num_src, H, F) or nullptr
  T* del;         // (num_src, H) or nullptr
  T* gx;          // (E, H) in CSR-of-A order, or nullptr
  const I* t2in;  // (E,) position in the CSR of A of each entry of A^T
  T* dw;          // (E,) or (E, H) as the weights, or nullptr
};

// dw of edge e from q = a_e d_e (HC heads): per head, or summed over the heads.
template <int HC, typename I>
inline void store_dw(const Gat<float, I>& g, const Grads<float, I>& d, int64_t e,
                     typename VecT<float, HC>::type q) {
  if (g.wh > 1) {
    std::memcpy(d.dw + e * HC, &q, sizeof(q));
    return;
  }
  float sum = 0.0f;
  for (int h = 0; h < HC; ++h) sum += q[h];
  d.dw[e] = sum;
}

// a (deg, H) and c = a w (deg, H) for the out-edges b .. b + deg of source u; requests the
// destination values kAhead entries ahead and, when `early`, the dout rows of this row.
template <int HC, typename T, typename I>
void edge_attention(const Gat<T, I>& g, const Grads<T, I>& d, int64_t u, int64_t b, int64_t deg, int64_t last,
                    int64_t early, T* __restrict A, T* __restrict C) {
  const int64_t H = HC > 0 ? HC : g.H, HF = H * g.F;
  const I* __restrict indices = g.indices;
  const T* __restrict elu = g.el + u * H;
  for (int64_t j = 0; j < deg; ++j) {
    if (b + j + kAhead < last) prefetch_row(d.rowv + static_cast<int64_t>(indices[b + j + kAhead]) * 4 * H, 4 * H);
    const int64_t v = indices[b + j];
    prefetch_row(d.dout + v * HF, early);
    const T* __restrict rv = d.rowv + v * 4 * H;
    const int64_t e = edge_id(g.eids, b + j);
    if constexpr (HC > 0 && std::is_same<T, float>::value) {
      using V = typename VecT<float, HC>::type;
      const V* r = reinterpret_cast<const V*>(rv);
      V z = *reinterpret_cast<const V*>(elu) + r[0];
      z = z > 0.0f ? z : z * g.slope;
      const V av = exp_vec(z - r[1]) * r[2];
      *reinterpret_cast<V*>(A + j * H) = av;
      *reinterpret_cast<V*>(C + j * H) = av * weight_vec<HC>(g, e);
    } else {
      for (int64_t h = 0; h < H; ++h) {
        const T av = exp_approx(leaky(elu[h] + rv[h], g.slope) - rv[H + h]) * rv[2 * H + h];
        A[j * H + h] = av;
        C[j * H + h] = av * weight_at(g, e, h);
      }
    }
  }
}

// P[j, h] = <dout[cols[j], h, :], fu[h, :]> for the deg entries of a row.
template <int FC, typename T, typename I>
void row_dots(const T* __restrict dout, const I* __restrict cols, const T* __restrict fu, int64_t deg,
              int64_t H, int64_t Fr, T* __restrict P) {
  const int64_t F = FC > 0 ? FC : Fr, HF = H * F;
  for (int64_t j = 0; j < deg; ++j) {
    const T* __restrict dv = dout + static_cast<int64_t>(cols[j]) * HF;
    for (int64_t h = 0; h < H; ++h) {
      const T* __restrict x = dv + h * F;
      const T* __restrict y = fu + h * F;
      T acc = T(0);
#pragma omp simd reduction(+ : acc)
      for (int64_t f = 0; f < F; ++f) acc += x[f] * y[f];
      P[j * H + h] = acc;
    }
  }
}

// From a (A), the dots (P) of the out-edges of source u: gx, dw per edge and del[u].
template <int HC, typename T, typename I>
void edge_score_grads(const Gat<T, I>& g, const Grads<T, I>& d, int64_t u, int64_t b, int64_t deg,
                      const T* __restrict A, const T* __restrict P) {
  const int64_t H = HC > 0 ? HC : g.H;
  const I* __restrict indices = g.indices;
  const T* __restrict elu = g.el + u * H;
  T* __restrict dl = d.del ? d.del + u * H : nullptr;
  if constexpr (HC > 0 && std::is_same<T, float>::value) {
    using V = typename VecT<float, HC>::type;
    V acc = V{};
    const V el = *reinterpret_cast<const V*>(elu);
    for (int64_t j = 0; j < deg; ++j) {
      const int64_t v = indices[b + j], e = edge_id(g.eids, b + j);
      const V* r = reinterpret_cast<const V*>(d.rowv + v * 4 * H);
      const V wv = weight_vec<HC>(g, e);
      const V av = *reinterpret_cast<const V*>(A + j * H);
      const V pv = *reinterpret_cast<const V*>(P + j * H);
      const V x = el + r[0];
      V dx = av * (pv * wv - r[3]);
      dx = x > 0.0f ? dx : dx * g.slope;
      acc += dx;
      if (d.gx) *reinterpret_cast<V*>(d.gx + static_cast<int64_t>(d.t2in[b + j]) * H) = dx;
      if (d.dw) store_dw<HC>(g, d, e, av * pv);
    }
    if (dl) *reinterpret_cast<V*>(dl) = acc;
  } else {
    if (dl) std::fill(dl, dl + H, T(0));
    for (int64_t j = 0; j < deg; ++j) {
      const int64_t v = indices[b + j], e = edge_id(g.eids, b + j);
      const T* __restrict rv = d.rowv + v * 4 * H;
      T dwe = T(0);
      for (int64_t h = 0; h < H; ++h) {
        const T av = A[j * H + h], pv = P[j * H + h];
        T dx = av * (weight_at(g, e, h) * pv - rv[3 * H + h]);
        const T scale[2] = {g.slope, T(1)};  // indexed by the sign, not a branch (see leaky)
        dx *= scale[elu[h] + rv[h] > T(0)];
        if (dl) dl[h] += dx;
        if (d.gx) d.gx[static_cast<int64_t>(d.t2in[b + j]) * H + h] = dx;
        if (d.dw && g.wh > 1) d.dw[e * H + h] = av * pv;
        dwe += av * pv;
      }
      if (d.dw && g.wh == 1) d.dw[e] = dwe;
    }
  }
}

template <typename T, typename I>
struct BackwardFns {
  void (*attention)(const Gat<T, I>&, const Grads<T, I>&, int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*);
  void (*score_grads)(const Gat<T, I>&, const Grads<T, I>&, int64_t, int64_t, int64_t, const T*, const T*);
};

template <typename T, typename I>
BackwardFns<T, I> backward_fns(int64_t H) {
  if constexpr (std::is_same<T, float>::value) {
    switch (H) {
      case 1: return {&edge_attention<1, T, I>, &edge_score_grads<1, T, I>};
      case 4: return {&edge_attention<4, T, I>, &edge_score_grads<4, T, I>};
      case 8: return {&edge_attention<8, T, I>, &edge_score_grads<8, T, I>};
      case 16: return {&edge_attention<16, T, I>, &edge_score_grads<16, T, I>};
      default: break;
    }
  }
  return {&edge_attention<0, T, I>, &edge_score_grads<0, T, I>};
}

template <int FC, typename T, typename I>
void backward_src_rows(const Gat<T, I>& g, const Grads<T, I>& d, int64_t r0, int64_t r1) {
  const int64_t H = g.H, F = FC > 0 ? FC : g.F, HF = H * F;
  const bool need_x = d.del || d.gx || d.dw;
  const int64_t last = g.indptr[r1];
  const int64_t early = std::min<int64_t>(HF, kEarlyRowBytes / static_cast<int64_t>(sizeof(T)));
  const auto fns = backward_fns<T, I>(H);
  std::vector<T> A, C, P;
  for (int64_t u = r0; u < r1; ++u) {
    const int64_t b = g.indptr[u], deg = g.indptr[u + 1] - b;
    if (deg == 0) {
      if (d.dfeat) std::fill(d.dfeat + u * HF, d.dfeat + u * HF + HF, T(0));
      if (d.del) std::fill(d.del + u * H, d.del + u * H + H, T(0));
      continue;
    }
    if (static_cast<int64_t>(A.size()) < deg * H) {
      A.resize(deg * H);
      C.resize(deg * H);
      P.resize(deg * H);
    }
    fns.attention(g, d, u, b, deg, last, early, A.data(), C.data());
    if (d.dfeat) gather_row<FC>(d.dout, g.indices + b, C.data(), deg, H, F, d.dfeat + u * HF);
    if (need_x) {
      row_dots<FC>(d.dout, g.indices + b, g.feat + u * HF, deg, H, F, P.data());
      fns.score_grads(g, d, u, b, deg, A.data(), P.data());
    }
  }
}

// The same backward for narrow heads (float, H in {4, 8, 16}, F <= 16), all in one walk over the
// out-edges: with dout transposed to (num_dst, F, H), every per-head quantity is one vector of H
// lanes, so the dots d_e are F multiply-adds of vectors (no horizontal sums) and dfeat[u]
// accumulates, transposed, in F vector registers.
template <int FC, int HC, typename I>
void backward_src_rows_narrow(const Gat<float, I>& g, const Grads<float, I>& d, const float* doutT, int64_t r0,
                              int64_t r1) {
  using V = typename VecT<float, HC>::type;
  constexpr int64_t HF = HC * FC;
  const I* __restrict indices = g.indices;
  const int64_t last = g.indptr[r1];
  const float slope = g.slope;
  for (int64_t u = r0; u < r1; ++u) {
    const int64_t b = g.indptr[u], deg = g.indptr[u + 1] - b;
    const float* fu = g.feat + u * HF;
    V fuT[FC], acc[FC];
    for (int f = 0; f < FC; ++f) {
      float lanes[HC];
      for (int h = 0; h < HC; ++h) lanes[h] = fu[h * FC + f];
      std::memcpy(&fuT[f], lanes, sizeof(V));
      acc[f] = V{};
    }
    const V el = *reinterpret_cast<const V*>(g.el + u * HC);
    V dl = V{};
    for (int64_t j = 0; j < deg; ++j) {
      if (b + j + kAhead < last) {
        const int64_t vn = indices[b + j + kAhead];
        prefetch_row(d.rowv + vn * 4 * HC, 4 * HC);
        prefetch_row(doutT + vn * HF, HF);
      }
      const int64_t v = indices[b + j], e = edge_id(g.eids, b + j);
      const V* r = reinterpret_cast<const V*>(d.rowv + v * 4 * HC);
      const V wv = weight_vec<HC>(g, e);
      const V x = el + r[0];
      const V z = x > 0.0f ? x : x * slope;
      const V a = exp_vec(z - r[1]) * r[2];
      const V c = a * wv;
      const V* dT = reinterpret_cast<const V*>(doutT + v * HF);
      V p = V{};
      for (int f = 0; f < FC; ++f) {
        p += dT[f] * fuT[f];
        acc[f] += c * dT[f];
      }
      V dx = a * (p * wv - r[3]);
      dx = x > 0.0f ? dx : dx * slope;
      dl += dx;
      if (d.gx) *reinterpret_cast<V*>(d.gx + static_cast<int64_t>(d.t2in[b + j]) * HC) = dx;
      if (d.dw) store_dw<HC>(g, d, e, a * p);
    }
    if (d.dfeat) {
      float* df = d.dfeat + u * HF;
      for (int f = 0; f < FC; ++f)
        for (int h = 0; h < HC; ++h) df[h * FC + f] = acc[f][h];
    }
    if (d.del) *reinterpret_cast<V*>(d.del + u * HC) = dl;
  }
}

// Calls fn(integral_constant<F>, integral_constant<H>) when (F, H) has a narrow-head kernel.
template <typename Fn>
bool dispatch_narrow(int64_t F, int64_t H, const Fn& fn) {
  auto heads = [&](auto fc) {
    switch (H) {
      case 4: fn(fc, std::integral_constant<int, 4>()); return true;
      case 8: fn(fc, std::integral_constant<int, 8>()); return true;
      case 16: fn(fc, std::integral_constant<int, 16>()); return true;
      default: return false;
    }
  };
  switch (F) {
    case 4: return heads(std::integral_constant<int, 4>());
    case 8: return heads(std::integral_constant<int, 8>());
    case 16: return heads(std::integral_constant<int, 16>());
    default: return false;
  }
}

// rowv (rows, 4, H) = [er, m, 1/S, D] per row with D[v, h] = <dout[v, h], out[v, h] - bias[h]>
// (out holds the bias when the forward added one).
template <int FC, typename T>
void pack_rows(const T* er, const T* mx, const T* inv, const T* dout, const T* out, const T* bias, int64_t rows,
               int64_t H, int64_t Fr, T* rowv) {
  const int64_t F = FC > 0 ? FC : Fr;
  at::parallel_for(0, rows, std::max<int64_t>(1, serial_work() / std::max<int64_t>(H * F, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t v = r0; v < r1; ++v) {
      T* rv = rowv + v * 4 * H;
      for (int64_t h = 0; h < H; ++h) {
        rv[h] = er[v * H + h];
        rv[H + h] = mx[v * H + h];
        rv[2 * H + h] = inv[v * H + h];
        const T* x = dout + (v * H + h) * F;
        const T* y = out + (v * H + h) * F;
        T acc = T(0);
        if (bias) {
          const T* b = bias + h * F;
#pragma omp simd reduction(+ : acc)
          for (int64_t f = 0; f < F; ++f) acc += x[f] * (y[f] - b[f]);
        } else {
#pragma omp simd reduction(+ : acc)
          for (int64_t f = 0; f < F; ++f) acc += x[f] * y[f];
        }
        rv[3 * H + h] = acc;
      }
    }
  });
}

// Row sums of gathered edge values: y[v, k] = sum_{j in row v} x[eids[j], k]; x (E, K).
template <typename T, typename I>
void gather_row_sum(const I* indptr, const I* eids, const T* x, int64_t rows, int64_t K, T* y) {
  parallel_rows(indptr, rows, (indptr[rows] - indptr[0]) * K, [&](int64_t r0, int64_t r1) {
    for (int64_t v = r0; v < r1; ++v) {
      T* yv = y + v * K;
      std::fill(yv, yv + K, T(0));
      for (int64_t j = indptr[v]; j < indptr[v + 1]; ++j) {
        const T* xe = x + edge_id(eids, j) * K;
        for (int64_t k = 0; k < K; ++k) yv[k] += xe[k];
      }
    }
  });
}

// Calls fn.template operator()<FC>() with FC the compile-time feature width when it is one of the
// specialised ones, else 0 (runtime width).
template <typename Fn>
void dispatch_width(int64_t F, const Fn& fn) {
  switch (F) {
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 16: fn(std::integral_constant<int, 16>()); break;
    case 32: fn(std::integral_constant<int, 32>()); break;
    case 64: fn(std::integral_constant<int, 64>()); break;
    case 128: fn(std::integral_constant<int, 128>()); break;
    case 256: fn(std::integral_constant<int, 256>()); break;
    default: fn(std::integral_constant<int, 0>()); break;
  }
}

void check_index(const at::Tensor& indptr, const at::Tensor& indices, const c10::optional<at::Tensor>& eids,
                 const char* name) {
  check_csr(indptr, indices, name);
  if (eids.has_value()) {
    TORCH_CHECK(eids->dim() == 1 && eids->is_contiguous() && eids->numel() == indices.numel(), name,
                ": eids must be contiguous, one per entry");
    TORCH_CHECK(eids->scalar_type() == indptr.scalar_type(), name, ": eids must share the index type");
  }
}

template <typename I>
const I* eid_ptr(const c10::optional<at::Tensor>& eids) {
  return eids.has_value() ? eids->data_ptr<I>() : nullptr;
}

template <typename T, typename I>
Gat<T, I> make_gat(const at::Tensor& indptr, const at::Tensor& indices, const c10::optional<at::Tensor>& eids,
                   const at::Tensor& el, const at::Tensor& er, const at::Tensor& feat,
                   const c10::optional<at::Tensor>& w, double slope) {
  Gat<T, I> g;
  g.indptr = indptr.data_ptr<I>();
  g.indices = indices.data_ptr<I>();
  g.eids = eid_ptr<I>(eids);
  g.el = el.data_ptr<T>();
  g.er = er.data_ptr<T>();
  g.feat = feat.data_ptr<T>();
  g.w = w.has_value() ? w->data_ptr<T>() : nullptr;
  g.slope = static_cast<T>(slope);
  g.H = feat.size(1);
  g.F = feat.size(2);
  g.wh = w.has_value() && g.H > 1 && indices.numel() > 0 && w->numel() == indices.numel() * g.H ? g.H : 1;
  return g;
}

void check_inputs(const at::Tensor& el, const at::Tensor& er, const at::Tensor& feat,
                  const c10::optional<at::Tensor>& w, int64_t n_src, int64_t n_dst, int64_t E, const char* name) {
  TORCH_CHECK(feat.dim() == 3 && feat.size(0) == n_src, name, ": feat must be (num_src, H, F)");
  const int64_t H = feat.size(1);
  TORCH_CHECK(el.dim() == 2 && el.size(0) == n_src && el.size(1) == H, name, ": el must be (num_src, H)");
  TORCH_CHECK(er.dim() == 2 && er.size(0) >= n_dst && er.size(1) == H, name, ": er must be (num_dst, H)");
  const auto dt = feat.scalar_type();
  check_dense(feat, "feat", name, dt);
  check_dense(el, "el", name, dt);
  check_dense(er, "er", name, dt);
  if (w.has_value()) {
    check_dense(*w, "edge weight", name, dt);
    TORCH_CHECK(w->numel() == E || w->numel() == E * H, name,
                ": one edge weight per edge, or per edge and head, expected");
  }
}

// The bias (H F,) of an epilogue, checked; undefined when absent.
at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& feat, const char* name) {
  if (!bias.has_value()) return at::Tensor();
  check_dense(*bias, "bias", name, feat.scalar_type());
  TORCH_CHECK(bias->numel() == feat.size(1) * feat.size(2), name, ": bias must hold H * F values");
  return *bias;
}

// (out, m, 1/S): out (num_dst, H, F) with num_dst = indptr.size(0) - 1; with a bias (H F,), the
// epilogue out[v] += bias as each row is written.
std::vector<at::Tensor> gat_forward(const at::Tensor& indptr, const at::Tensor& indices,
                                    const c10::optional<at::Tensor>& eids, const at::Tensor& el,
                                    const at::Tensor& er, const at::Tensor& feat,
                                    const c10::optional<at::Tensor>& w, double slope,
                                    const c10::optional<at::Tensor>& bias_) {
  const char* name = "granii::gat_forward";
  check_index(indptr, indices, eids, name);
  const int64_t rows = indptr.size(0) - 1, H = feat.size(1), F = feat.size(2), E = indices.size(0);
  check_inputs(el, er, feat, w, el.size(0), rows, E, name);
  const auto bias = checked_bias(bias_, feat, name);
  auto out = at::empty({rows, H, F}, feat.options());
  auto mx = at::empty({rows, H}, feat.options());
  auto inv = at::empty({rows, H}, feat.options());
  AT_DISPATCH_FLOATING_TYPES(feat.scalar_type(), "gat_forward", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), name, [&] {
      const auto g = make_gat<T, index_t>(indptr, indices, eids, el, er, feat, w, slope);
      dispatch_width(F, [&](auto fc) {
        parallel_rows(g.indptr, rows, E * H * F, [&](int64_t r0, int64_t r1) {
          forward_rows<decltype(fc)::value>(g, bias.defined() ? bias.data_ptr<T>() : nullptr, out.data_ptr<T>(),
                                            mx.data_ptr<T>(), inv.data_ptr<T>(), r0, r1);
        });
      });
    });
  });
  return {out, mx, inv};
}

// Gradients [del, der, dfeat, dw] of gat_forward, an empty tensor where need_* is false.
// t_* is the CSR of A^T (rows = sources), in_* the CSR of A.
std::vector<at::Tensor> gat_backward(const at::Tensor& in_indptr, const at::Tensor& t2in,
                                     const at::Tensor& t_indptr, const at::Tensor& t_indices,
                                     const c10::optional<at::Tensor>& t_eids, const at::Tensor& el,
                                     const at::Tensor& er, const at::Tensor& feat,
                                     const c10::optional<at::Tensor>& w, double slope, const at::Tensor& mx,
                                     const at::Tensor& inv, const at::Tensor& out, const at::Tensor& dout_,
                                     bool need_el, bool need_er, bool need_feat, bool need_w,
                                     const c10::optional<at::Tensor>& bias_) {
  const char* name = "granii::gat_backward";
  const auto bias = checked_bias(bias_, feat, name);
  check_index(t_indptr, t_indices, t_eids, name);
  TORCH_CHECK(t2in.scalar_type() == t_indptr.scalar_type() && t2in.is_contiguous() &&
              t2in.numel() == t_indices.numel(), name, ": t2in must hold one position per entry, index type");
  TORCH_CHECK(in_indptr.scalar_type() == t_indptr.scalar_type(), name, ": in_indptr must share the index type");
  const int64_t n_src = t_indptr.size(0) - 1, n_dst = in_indptr.size(0) - 1;
  const int64_t H = feat.size(1), F = feat.size(2), E = t_indices.size(0);
  check_inputs(el, er, feat, w, n_src, n_dst, E, name);
  const auto dout = dout_.contiguous();
  TORCH_CHECK(dout.sizes() == out.sizes() && out.size(0) == n_dst, name, ": dout must be (num_dst, H, F)");
  at::Tensor del, der, dfeat, dw, gx;
  if (need_el) del = at::empty({n_src, H}, feat.options());
  if (need_er) gx = at::empty({E, H}, feat.options());
  if (need_feat) dfeat = at::empty({n_src, H, F}, feat.options());
  if (need_w && w.has_value()) dw = at::empty({w->numel()}, feat.options());
  auto rowv = at::empty({n_dst, 4, H}, feat.options());
  AT_DISPATCH_FLOATING_TYPES(feat.scalar_type(), "gat_backward", [&] {
    using T = scalar_t;
    dispatch_width(F, [&](auto fc) {
      pack_rows<decltype(fc)::value, T>(er.data_ptr<T>(), mx.data_ptr<T>(), inv.data_ptr<T>(), dout.data_ptr<T>(),
                                        out.data_ptr<T>(), bias.defined() ? bias.data_ptr<T>() : nullptr, n_dst, H,
                                        F, rowv.data_ptr<T>());
    });
    GRANII_DISPATCH_INDEX(t_indptr.scalar_type(), name, [&] {
      const auto g = make_gat<T, index_t>(t_indptr, t_indices, t_eids, el, er, feat, w, slope);
      Grads<T, index_t> d{dout.data_ptr<T>(), rowv.data_ptr<T>(), need_feat ? dfeat.data_ptr<T>() : nullptr,
                          need_el ? del.data_ptr<T>() : nullptr, need_er ? gx.data_ptr<T>() : nullptr,
                          t2in.data_ptr<index_t>(), dw.defined() ? dw.data_ptr<T>() : nullptr};
      bool narrow = false;
      if constexpr (std::is_same<T, float>::value) {
        const auto doutT = dispatch_narrow(F, H, [](auto, auto) {}) ? dout.transpose(1, 2).contiguous()
                                                                     : at::Tensor();  // (num_dst, F, H)
        if (doutT.defined()) narrow = dispatch_narrow(F, H, [&](auto fc, auto hc) {
          parallel_rows(g.indptr, n_src, 2 * E * H * F, [&](int64_t r0, int64_t r1) {
            backward_src_rows_narrow<decltype(fc)::value, decltype(hc)::value>(g, d, doutT.data_ptr<T>(), r0, r1);
          });
        });
      }
      if (!narrow) {
        dispatch_width(F, [&](auto fc) {
          parallel_rows(g.indptr, n_src, 2 * E * H * F, [&](int64_t r0, int64_t r1) {
            backward_src_rows<decltype(fc)::value>(g, d, r0, r1);
          });
        });
      }
      if (need_er) {
        der = at::empty({n_dst, H}, feat.options());
        gather_row_sum<T, index_t>(in_indptr.data_ptr<index_t>(), static_cast<const index_t*>(nullptr),
                                   gx.data_ptr<T>(), n_dst, H, der.data_ptr<T>());
      }
    });
  });
  const auto none = at::empty({0}, feat.options());  // a Tensor[] cannot hold undefined entries
  return {del.defined() ? del : none, der.defined() ? der : none, dfeat.defined() ? dfeat : none,
          dw.defined() ? dw : none};
}

// ---------------------------------------------------------------------------------------------
// SDDMM add: out[e, k] = a[src[e], k] + b[dst[e], k] in edge-id order.
at::Tensor sddmm_add(at::Tensor src, at::Tensor dst, at::Tensor a, at::Tensor b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "granii: a (n, K), b (m, K)");
  a = a.contiguous();
  b = b.contiguous();
  const int64_t E = src.size(0), K = a.size(1);
  auto out = at::empty({E, K}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "sddmm_add", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(src.scalar_type(), "granii", [&] {
      using I = index_t;
      const I* s = src.data_ptr<I>();
      const I* d = dst.data_ptr<I>();
      const T* pa = a.data_ptr<T>();
      const T* pb = b.data_ptr<T>();
      T* po = out.data_ptr<T>();
      const int64_t grain = std::max<int64_t>(1, serial_work() / std::max<int64_t>(K, 1));
      at::parallel_for(0, E, grain, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const T* ra = pa + static_cast<int64_t>(s[e]) * K;
          const T* rb = pb + static_cast<int64_t>(d[e]) * K;
          T* ro = po + e * K;
          for (int64_t k = 0; k < K; ++k) ro[k] = ra[k] + rb[k];
        }
      });
    });
  });
  return out;
}

// y (rows, K): y[v] = sum over row v of x[eids[j]], x (E, K) in edge-id order.
at::Tensor edge_row_sum(const at::Tensor& indptr, const c10::optional<at::Tensor>& eids, at::Tensor x) {
  x = x.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = x.size(1);
  auto y = at::empty({rows, K}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "edge_row_sum", [&] {
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "granii", [&] {
      using I = index_t;
      gather_row_sum<scalar_t, I>(indptr.data_ptr<I>(), eid_ptr<I>(eids), x.data_ptr<scalar_t>(), rows, K,
                                  y.data_ptr<scalar_t>());
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Edge softmax over the in-edges of each row: a[e,k] = exp(x[e,k] - m_v) / sum exp(x[e',k] - m_v).
at::Tensor edge_softmax_forward(const at::Tensor& indptr, const c10::optional<at::Tensor>& eids, at::Tensor x) {
  x = x.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = x.size(1);
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "edge_softmax_forward", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "granii", [&] {
      using I = index_t;
      const I* ip = indptr.data_ptr<I>();
      const I* ei = eid_ptr<I>(eids);
      const T* px = x.data_ptr<T>();
      T* py = y.data_ptr<T>();
      parallel_rows(ip, rows, (ip[rows] - ip[0]) * K * 4, [&](int64_t r0, int64_t r1) {
        if constexpr (std::is_same<T, float>::value) {
          if (K == 1) {     // one score per edge: gathered into a row buffer, exp vectorised
            std::vector<float> buf;
            for (int64_t v = r0; v < r1; ++v) {
              const int64_t b = ip[v], deg = ip[v + 1] - b;
              if (deg == 0) continue;
              if (static_cast<int64_t>(buf.size()) < deg) buf.resize(deg);
              float mv = -std::numeric_limits<float>::infinity();
              for (int64_t j = 0; j < deg; ++j) {
                buf[j] = px[edge_id(ei, b + j)];
                mv = std::max(mv, buf[j]);
              }
              const float r = 1.0f / exp_shift_sum(buf.data(), deg, mv);
              for (int64_t j = 0; j < deg; ++j) py[edge_id(ei, b + j)] = buf[j] * r;
            }
            return;
          }
        }
        std::vector<T> m(K), s(K);
        for (int64_t v = r0; v < r1; ++v) {
          const int64_t b = ip[v], e = ip[v + 1];
          if (b == e) continue;
          std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
          for (int64_t j = b; j < e; ++j) {
            const T* xe = px + edge_id(ei, j) * K;
            for (int64_t k = 0; k < K; ++k) m[k] = std::max(m[k], xe[k]);
          }
          std::fill(s.begin(), s.end(), T(0));
          for (int64_t j = b; j < e; ++j) {
            const int64_t off = edge_id(ei, j) * K;
            for (int64_t k = 0; k < K; ++k) {
              const T p = exp_approx(px[off + k] - m[k]);
              py[off + k] = p;
              s[k] += p;
            }
          }
          for (int64_t k = 0; k < K; ++k) s[k] = T(1) / s[k];
          for (int64_t j = b; j < e; ++j) {
            T* ye = py + edge_id(ei, j) * K;
            for (int64_t k = 0; k < K; ++k) ye[k] *= s[k];
          }
        }
      });
    });
  });
  return y;
}

// dx[e] = a[e] (g[e] - sum_{e' in row} a[e'] g[e']).
at::Tensor edge_softmax_backward(const at::Tensor& indptr, const c10::optional<at::Tensor>& eids, at::Tensor a,
                                 at::Tensor g) {
  a = a.contiguous();
  g = g.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = a.size(1);
  auto dx = at::empty_like(a);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "edge_softmax_backward", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "granii", [&] {
      using I = index_t;
      const I* ip = indptr.data_ptr<I>();
      const I* ei = eid_ptr<I>(eids);
      const T* pa = a.data_ptr<T>();
      const T* pg = g.data_ptr<T>();
      T* pd = dx.data_ptr<T>();
      parallel_rows(ip, rows, (ip[rows] - ip[0]) * K * 2, [&](int64_t r0, int64_t r1) {
        std::vector<T> s(K);
        for (int64_t v = r0; v < r1; ++v) {
          std::fill(s.begin(), s.end(), T(0));
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            const int64_t off = edge_id(ei, j) * K;
            for (int64_t k = 0; k < K; ++k) s[k] += pa[off + k] * pg[off + k];
          }
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            const int64_t off = edge_id(ei, j) * K;
            for (int64_t k = 0; k < K; ++k) pd[off + k] = pa[off + k] * (pg[off + k] - s[k]);
          }
        }
      });
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def(
      "gat_forward(Tensor indptr, Tensor indices, Tensor? eids, Tensor el, Tensor er, Tensor feat, "
      "Tensor? w, float slope, Tensor? bias=None) -> Tensor[]");
  m.def(
      "gat_backward(Tensor in_indptr, Tensor t2in, Tensor t_indptr, Tensor t_indices, "
      "Tensor? t_eids, Tensor el, Tensor er, Tensor feat, Tensor? w, float slope, Tensor mx, "
      "Tensor inv, Tensor out, Tensor dout, bool need_el, bool need_er, bool need_feat, "
      "bool need_w, Tensor? bias=None) -> Tensor[]");
  m.def("sddmm_add_coo(Tensor src, Tensor dst, Tensor a, Tensor b) -> Tensor");
  m.def("edge_row_sum(Tensor indptr, Tensor? eids, Tensor x) -> Tensor");
  m.def("edge_softmax_csr(Tensor indptr, Tensor? eids, Tensor x) -> Tensor");
  m.def("edge_softmax_csr_backward(Tensor indptr, Tensor? eids, Tensor a, Tensor g) -> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("gat_forward", &gat_forward);
  m.impl("gat_backward", &gat_backward);
  m.impl("sddmm_add_coo", &sddmm_add);
  m.impl("edge_row_sum", &edge_row_sum);
  m.impl("edge_softmax_csr", &edge_softmax_forward);
  m.impl("edge_softmax_csr_backward", &edge_softmax_backward);
}

}  // namespace granii
