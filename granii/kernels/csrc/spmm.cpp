// SpMM family over CSR: Y = act(diag(rs) A_val diag(cs) X + bias), and the SDDMM-dot that gives
// the gradient of the edge values.
//
//   granii::spmm_csr(indptr, indices, x, val, val_perm, row_scale, col_scale, bias, act, parts, res)
//       x (n_cols, H, K); val (nnz, H) in CSR order, or in another order read through val_perm
//       (val[val_perm[j]] for CSR entry j, e.g. DGL edge ids); row_scale (rows,), col_scale
//       (n_cols,), bias (H * K,); act 0 = none, 1 = relu; res (rows, H * K), rows of any stride.
//       Returns (rows, H, K):
//       Y[r, h] = act(rs[r] * sum_{j in row r} val[j, h] * cs[col_j] * X[col_j, h] + bias[h]
//                     + res[r, h]).
//       Every optional input may be None. The row and column scales are gathered per row and per
//       nonzero: a normalised product D_dst^a A D_src^b X needs no E-sized value array and no extra
//       N x K pass. Shared features: x (n_cols, 1, K) with val (nnz, H), H > 1, is read by every
//       head (Y[r, h] = sum_j val[j, h] X[col_j]): GAT aggregating raw features before the
//       per-head projection. The heads are then the inner loop of each row, so the row's
//       gathered x rows are read from cache by all heads.
//   granii::sddmm_dot_csr(indptr, indices, perm, a, b, parts)
//       a (rows, H, K), b (n_cols, H, K): out[perm[j], h] = <a[r, h], b[col_j, h]> for each CSR
//       entry j of row r (out[j, h] without perm). Returns (nnz, H). b may be (n_cols, 1, K),
//       shared by the heads: out[., h] = <a[r, h], b[col_j, 0]>.
//   granii::parallel_threads() -> int: the threads an at::parallel_for region of this extension
//       runs with now (tests check that torch.set_num_threads is honoured).
//   granii::serial_work() -> int: the work below which a kernel stays on the calling thread
//       (native.h; it depends on OMP_WAIT_POLICY).
//
// Inner loops: the feature dimension is tiled with compile-time tile widths (64, then 32, 16, 8,
// 4, 2, 1 for the remainder), so each tile's accumulator lives in vector registers while the
// row's nonzeros are walked once per tile; the variants with/without values and column scale are
// separate instantiations, so the unweighted loop is a plain gather-add.
#include "native.h"

#include <torch/library.h>

#include <vector>

namespace granii {
namespace {

constexpr int64_t kActNone = 0;
constexpr int64_t kActRelu = 1;

#ifndef GRANII_SPMM_TILE
#define GRANII_SPMM_TILE 64
#endif
#ifndef GRANII_FBLOCK
#define GRANII_FBLOCK 0
#endif
#ifndef GRANII_PREFETCH
#define GRANII_PREFETCH 0
#endif

template <typename scalar_t, typename index_t>
struct SpmmArgs {
  const index_t* indptr;
  const index_t* indices;
  int64_t rows, nnz;
  const scalar_t* x;      // (n_cols, H, K), or (n_cols, 1, K) shared by the heads
  int64_t H, K, F;        // F = H * K: row stride of y
  int64_t FX;             // row stride of x: F, or K when x is shared by the heads
  const scalar_t* val;    // (nnz or E, H) or null
  const index_t* vperm;   // null: val in CSR order
  const scalar_t* rs;     // (rows,) or null
  const scalar_t* cs;     // (n_cols,) or null
  const scalar_t* bias;   // (F,) or null
  int64_t act;
  scalar_t* y;            // (rows, H, K)
  const scalar_t* res;    // (rows, F) with row stride res_stride, or null
  int64_t res_stride;
};

// Vector registers as GCC/Clang vector types (the compiler maps them onto SSE, AVX2 or AVX-512,
// whatever -march allows). Left to itself, GCC vectorised the tile loops across nonzeros with
// gathers and kept the accumulator on the stack; explicit vectors keep it in registers.
template <typename T, int L>
struct Vec;
#define GRANII_VEC(T, L) \
  template <>            \
  struct Vec<T, L> {     \
    typedef T type __attribute__((vector_size(sizeof(T) * L), aligned(sizeof(T)), may_alias)); \
  };
GRANII_VEC(float, 16)
GRANII_VEC(float, 8)
GRANII_VEC(float, 4)
GRANII_VEC(double, 8)
GRANII_VEC(double, 4)
GRANII_VEC(double, 2)
#undef GRANII_VEC
template <typename T>
struct Vec<T, 1> {
  typedef T type;
};

// Bytes of one vector register: a wider vector type is split into several registers, and a
// tile of them spills where the register file is smaller (AVX2: 16 ymm).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#else
constexpr int kVecBytes = 32;
#endif

// Lanes per vector for a tile of TW features: up to one register, at least 16 bytes, else scalar.
template <typename T, int TW>
constexpr int lanes() {
  constexpr int full = kVecBytes / static_cast<int>(sizeof(T));
  constexpr int l = TW < full ? TW : full;
  return l * static_cast<int>(sizeof(T)) >= 16 ? l : 1;
}

// One tile of TW features of one (partial) row: out[0:TW] = sum_j s_j * x[col_j, 0:TW] with
// s_j = val[j] * cs[col_j] (either factor may be absent); then, if fin, the epilogue
// act(acc * rsv + bias + res).
template <int TW, bool HV, bool HC, typename scalar_t, typename index_t>
__attribute__((always_inline)) inline void tile(
    const SpmmArgs<scalar_t, index_t>& a, const scalar_t* __restrict x,
    const scalar_t* __restrict val, int64_t e0, int64_t e1, scalar_t* __restrict out, bool fin,
    scalar_t rsv, const scalar_t* __restrict bias, const scalar_t* __restrict res) {
  if constexpr ((TW & (TW - 1)) != 0 && lanes<scalar_t, TW>() != 1) {
    // a width of 16 bytes or more that is no power of two (one-hot node labels: 5, 6, 7, 12;
    // narrower widths are scalar lanes already): a plain array of
    // accumulators the compiler vectorizes, so the row's nonzeros are walked once, where the
    // generic tiles (4 + 2 + 1 for 7) walk them once per tile, 2.4x the time of 8 features
    scalar_t acc[TW] = {};
    for (int64_t j = e0; j < e1; ++j) {
      const int64_t c = a.indices[j];
      const scalar_t* __restrict xr = x + c * a.FX;
      scalar_t s = scalar_t(1);
      if constexpr (HV) {
        s = val[(a.vperm ? static_cast<int64_t>(a.vperm[j]) : j) * a.H];
        if constexpr (HC) s *= a.cs[c];
      } else if constexpr (HC) {
        s = a.cs[c];
      }
      for (int f = 0; f < TW; ++f) acc[f] += s * xr[f];
    }
    if (fin) {
      for (int f = 0; f < TW; ++f) {
        scalar_t v = acc[f] * rsv + (bias ? bias[f] : scalar_t(0)) + (res ? res[f] : scalar_t(0));
        acc[f] = (a.act == kActRelu && v < 0) ? scalar_t(0) : v;
      }
    }
    for (int f = 0; f < TW; ++f) out[f] = acc[f];
    return;
  } else {
  constexpr int L = lanes<scalar_t, TW>();
  constexpr int NV = TW / L;
  static_assert(NV * L == TW, "tile width must be a multiple of the vector lanes");
  using vec = typename Vec<scalar_t, L>::type;
  const index_t* __restrict col = a.indices;
  const index_t* __restrict vperm = a.vperm;
  const scalar_t* __restrict cs = a.cs;
  const int64_t H = a.H;
  vec acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = vec{} ;
  for (int64_t j = e0; j < e1; ++j) {
    const int64_t c = col[j];
    const vec* xr = reinterpret_cast<const vec*>(x + c * a.FX);
#if GRANII_PREFETCH > 0
    if (j + GRANII_PREFETCH < e1) {
      const char* xp = reinterpret_cast<const char*>(
          x + static_cast<int64_t>(col[j + GRANII_PREFETCH]) * a.FX);
      for (int b = 0; b < TW * static_cast<int>(sizeof(scalar_t)); b += 64)
        __builtin_prefetch(xp + b);
    }
#endif
    if constexpr (HV || HC) {
      scalar_t s;
      if constexpr (HV) {
        s = val[(vperm ? static_cast<int64_t>(vperm[j]) : j) * H];
        if constexpr (HC) s *= cs[c];
      } else {
        s = cs[c];
      }
      for (int i = 0; i < NV; ++i) acc[i] += s * xr[i];
    } else {
      for (int i = 0; i < NV; ++i) acc[i] += xr[i];
    }
  }
  if (fin) {
    if (bias) {
      const vec* b = reinterpret_cast<const vec*>(bias);
      for (int i = 0; i < NV; ++i) acc[i] = acc[i] * rsv + b[i];
    } else {
      for (int i = 0; i < NV; ++i) acc[i] *= rsv;
    }
    if (res) {
      const vec* rr = reinterpret_cast<const vec*>(res);
      for (int i = 0; i < NV; ++i) acc[i] += rr[i];
    }
    if (a.act == kActRelu) {
      for (int i = 0; i < NV; ++i) acc[i] = acc[i] < 0 ? vec{} : acc[i];
    }
  }
  vec* o = reinterpret_cast<vec*>(out);
  for (int i = 0; i < NV; ++i) o[i] = acc[i];
  }
}

// Features [f0, f0 + width) of one head's output (from x's columns [xf0, xf0 + width)): the
// widest tiles first, then the remainder.
template <bool HV, bool HC, typename scalar_t, typename index_t>
inline void head_segment(const SpmmArgs<scalar_t, index_t>& a, int64_t xf0, int64_t f0,
                         int64_t width, const scalar_t* val, int64_t e0, int64_t e1, scalar_t* out,
                         bool fin, scalar_t rsv, const scalar_t* res) {
  const scalar_t* x = a.x + xf0;
  const scalar_t* bias = a.bias ? a.bias + f0 : nullptr;
  if (res) res += f0;
  out += f0;
  int64_t f = 0;
#define GRANII_TILE(TW)                                                                  \
  tile<TW, HV, HC>(a, x + f, val, e0, e1, out + f, fin, rsv, bias ? bias + f : nullptr, \
                   res ? res + f : nullptr);                                             \
  f += TW;
  for (; f + GRANII_SPMM_TILE <= width;) {
    GRANII_TILE(GRANII_SPMM_TILE)
  }
#if GRANII_SPMM_TILE > 64
  if (width - f >= 64) { GRANII_TILE(64) }
#endif
#if GRANII_SPMM_TILE > 32
  if (width - f >= 32) { GRANII_TILE(32) }
#endif
  if (width - f >= 16) { GRANII_TILE(16) }
  if (width - f >= 8) { GRANII_TILE(8) }
  if (width - f >= 4) { GRANII_TILE(4) }
  if (width - f >= 2) { GRANII_TILE(2) }
  if (width - f >= 1) { GRANII_TILE(1) }
#undef GRANII_TILE
}

template <typename scalar_t, typename index_t>
inline void epilogue(const SpmmArgs<scalar_t, index_t>& a, int64_t r) {
  scalar_t* out = a.y + r * a.F;
  const scalar_t rsv = a.rs ? a.rs[r] : scalar_t(1);
  const scalar_t* res = a.res ? a.res + r * a.res_stride : nullptr;
  for (int64_t f = 0; f < a.F; ++f) {
    scalar_t v = out[f] * rsv + (a.bias ? a.bias[f] : scalar_t(0)) + (res ? res[f] : scalar_t(0));
    out[f] = (a.act == kActRelu && v < 0) ? scalar_t(0) : v;
  }
}

// Feature block width (in elements) of the outer feature loop: each part walks its rows once per
// block, so the rows of x it gathers (n_cols x block) stay in cache for large widths.
template <typename scalar_t>
inline int64_t feature_block(int64_t requested, int64_t n_cols, int64_t K) {
  if (requested > 0) return requested;
#if GRANII_FBLOCK > 0
  return GRANII_FBLOCK;
#else
  (void)n_cols;
  return K;
#endif
}

// TW > 0: every row is one tile of exactly TW = K features of one head (``spmm_dispatch``), so a
// whole row is a single inlined loop over its nonzeros; rows of few nonzeros (batches of small
// graphs, sampled blocks) otherwise pay more for the per-row tile selection than for the row.
template <int TW, bool HV, bool HC, typename scalar_t, typename index_t>
void spmm_run(const SpmmArgs<scalar_t, index_t>& a, int64_t parts, int64_t block) {
  const index_t* indptr = a.indptr;
  const int64_t F = a.F, K = a.K;
  // partial sums of rows split between parts: at most two per part
  std::vector<scalar_t> carry(parts > 1 ? parts * 2 * F : 0);
  std::vector<int64_t> carry_row(parts > 1 ? parts * 2 : 0, -1);
  // heads outside the rows (each head's x columns are their own), or inside each row when x is
  // shared by the heads
  const bool shared = a.FX != a.F;
  const int64_t outer = shared ? 1 : a.H, inner = shared ? a.H : 1;
  for_each_part(parts, indptr, a.rows, a.nnz, [&](int64_t p, Coord b, Coord e) {
    for (int64_t ho = 0; ho < outer; ++ho) {
      for (int64_t f0 = 0; f0 < K; f0 += block) {
        const int64_t width = std::min(block, K - f0);
        auto segment = [&](int64_t e0, int64_t e1, scalar_t* out, bool fin, scalar_t rsv,
                           const scalar_t* res) {
          for (int64_t hi = 0; hi < inner; ++hi) {
            const int64_t h = ho + hi;
            head_segment<HV, HC>(a, (shared ? 0 : h * K) + f0, h * K + f0, width,
                                 a.val ? a.val + h : nullptr, e0, e1, out, fin, rsv, res);
          }
        };
        int slot = 0;
        for (int64_t r = b.row; r < e.row; ++r) {
          const int64_t start = indptr[r], stop = indptr[r + 1];
          if (start >= b.nz) {
            if constexpr (TW > 0) {
              tile<TW, HV, HC>(a, a.x, a.val, start, stop, a.y + r * F, true,
                               a.rs ? a.rs[r] : scalar_t(1), a.bias,
                               a.res ? a.res + r * a.res_stride : nullptr);
            } else {
              segment(start, stop, a.y + r * F, true, a.rs ? a.rs[r] : scalar_t(1),
                      a.res ? a.res + r * a.res_stride : nullptr);
            }
          } else {  // began in an earlier part
            carry_row[p * 2 + slot] = r;
            segment(b.nz, stop, carry.data() + (p * 2 + slot) * F, false, scalar_t(1), nullptr);
            ++slot;
          }
        }
        if (e.row < a.rows) {  // a row that continues in a later part
          const int64_t r = e.row;
          const int64_t start = std::max<int64_t>(indptr[r], b.nz);
          if (e.nz > start) {
            carry_row[p * 2 + slot] = r;
            segment(start, e.nz, carry.data() + (p * 2 + slot) * F, false, scalar_t(1), nullptr);
          }
        }
      }
    }
  });
  // add the partial sums of split rows in part order, then their epilogue
  int64_t last = -1;
  for (int64_t s = 0; s < static_cast<int64_t>(carry_row.size()); ++s) {
    const int64_t r = carry_row[s];
    if (r < 0) continue;
    scalar_t* out = a.y + r * F;
    const scalar_t* c = carry.data() + s * F;
    if (r != last) {
      if (last >= 0) epilogue(a, last);
      std::copy(c, c + F, out);
      last = r;
    } else {
      for (int64_t f = 0; f < F; ++f) out[f] += c[f];
    }
  }
  if (last >= 0) epilogue(a, last);
}

// spmm_run with the row loop specialised for the feature widths of small layers (float32, one
// head, one feature block); other widths take the generic tiles.
template <bool HV, bool HC, typename scalar_t, typename index_t>
void spmm_dispatch(const SpmmArgs<scalar_t, index_t>& a, int64_t parts, int64_t block) {
  if constexpr (std::is_same<scalar_t, float>::value) {
    if (a.H == 1 && block == a.K) {
      switch (a.K) {
        case 1: return spmm_run<1, HV, HC>(a, parts, block);
        case 2: return spmm_run<2, HV, HC>(a, parts, block);
        case 3: return spmm_run<3, HV, HC>(a, parts, block);
        case 4: return spmm_run<4, HV, HC>(a, parts, block);
        case 5: return spmm_run<5, HV, HC>(a, parts, block);
        case 6: return spmm_run<6, HV, HC>(a, parts, block);
        case 7: return spmm_run<7, HV, HC>(a, parts, block);
        case 8: return spmm_run<8, HV, HC>(a, parts, block);
        case 12: return spmm_run<12, HV, HC>(a, parts, block);
        case 16: return spmm_run<16, HV, HC>(a, parts, block);
        case 32: return spmm_run<32, HV, HC>(a, parts, block);
        case 64: return spmm_run<64, HV, HC>(a, parts, block);
        default: break;
      }
    }
  }
  spmm_run<0, HV, HC>(a, parts, block);
}

at::Tensor spmm_csr(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& x,
                    const c10::optional<at::Tensor>& val, const c10::optional<at::Tensor>& val_perm,
                    const c10::optional<at::Tensor>& row_scale,
                    const c10::optional<at::Tensor>& col_scale,
                    const c10::optional<at::Tensor>& bias, int64_t act, int64_t parts,
                    const c10::optional<at::Tensor>& res) {
  const char* name = "granii::spmm_csr";
  check_csr(indptr, indices, name);
  TORCH_CHECK(x.dim() == 3, name, ": x must be (n, H, K)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, name, ": float32 or float64 expected");
  check_dense(x, "x", name, dtype);
  TORCH_CHECK(act == kActNone || act == kActRelu, name, ": act must be 0 (none) or 1 (relu)");
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  const int64_t ncols = x.size(0), K = x.size(2);
  int64_t H = x.size(1);
  bool shared = false;  // x (n, 1, K) read by each of val's H > 1 heads
  if (val) {
    check_dense(*val, "val", name, dtype);
    TORCH_CHECK(val->dim() >= 1, name, ": val must be (E, H)");
    const int64_t vh = val->size(0) ? val->numel() / val->size(0) : H;
    if (H == 1 && vh > 1) {
      H = vh;
      shared = true;
    }
    TORCH_CHECK(val->numel() == val->size(0) * H, name,
                ": val must be (E, H) with H = x.size(1), or x (n, 1, K) shared by H heads");
    if (val_perm) {
      TORCH_CHECK(val_perm->scalar_type() == indices.scalar_type() && val_perm->is_contiguous() &&
                      val_perm->numel() == nnz,
                  name, ": val_perm must be a contiguous index vector of nnz entries");
    } else {
      TORCH_CHECK(val->size(0) == nnz, name, ": val must have one row per CSR entry");
    }
  }
  if (row_scale) {
    check_dense(*row_scale, "row_scale", name, dtype);
    TORCH_CHECK(row_scale->numel() == rows, name, ": row_scale must have one entry per row");
  }
  if (col_scale) {
    check_dense(*col_scale, "col_scale", name, dtype);
    TORCH_CHECK(col_scale->numel() == ncols, name, ": col_scale must have x.size(0) entries");
  }
  if (bias) {
    check_dense(*bias, "bias", name, dtype);
    TORCH_CHECK(bias->numel() == H * K, name, ": bias must have H * K entries");
  }
  if (res) {
    TORCH_CHECK(res->scalar_type() == dtype && res->dim() == 2 && res->size(0) == rows &&
                    res->size(1) == H * K && res->stride(1) == 1,
                name, ": res must be (rows, H * K) of x's dtype with unit column stride");
  }
  auto y = at::empty({rows, H, K}, x.options());
  if (rows == 0 || H * K == 0) return y;
  // without values the heads share every scale: one head of H * K features
  const bool flat = !val && H > 1;
  AT_DISPATCH_FLOATING_TYPES(dtype, "granii::spmm_csr", [&] {
    GRANII_DISPATCH_INDEX(indices.scalar_type(), "granii::spmm_csr", [&] {
      SpmmArgs<scalar_t, index_t> a{
          indptr.data_ptr<index_t>(),
          indices.data_ptr<index_t>(),
          rows,
          nnz,
          x.data_ptr<scalar_t>(),
          flat ? 1 : H,
          flat ? H * K : K,
          H * K,
          shared ? K : H * K,
          val ? val->data_ptr<scalar_t>() : nullptr,
          (val && val_perm) ? val_perm->data_ptr<index_t>() : nullptr,
          row_scale ? row_scale->data_ptr<scalar_t>() : nullptr,
          col_scale ? col_scale->data_ptr<scalar_t>() : nullptr,
          bias ? bias->data_ptr<scalar_t>() : nullptr,
          act,
          y.data_ptr<scalar_t>(),
          res ? res->data_ptr<scalar_t>() : nullptr,
          res ? res->stride(0) : 0};
      const int64_t p = num_parts(parts, rows, nnz, H * K);
      const int64_t fb = feature_block<scalar_t>(0, ncols, a.K);
      if (a.val && a.cs) {
        spmm_dispatch<true, true>(a, p, fb);
      } else if (a.val) {
        spmm_dispatch<true, false>(a, p, fb);
      } else if (a.cs) {
        spmm_dispatch<false, true>(a, p, fb);
      } else {
        spmm_dispatch<false, false>(a, p, fb);
      }
    });
  });
  return y;
}

// <a[0:K], b[0:K]> with two vector accumulators (the compiler does not reorder a float sum
// into vectors by itself).
template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t K) {
  constexpr int L = kVecBytes / static_cast<int>(sizeof(T));
  using vec = typename Vec<T, L>::type;
  vec s0{}, s1{};
  int64_t k = 0;
  for (; k + 2 * L <= K; k += 2 * L) {
    s0 += *reinterpret_cast<const vec*>(a + k) * *reinterpret_cast<const vec*>(b + k);
    s1 += *reinterpret_cast<const vec*>(a + k + L) * *reinterpret_cast<const vec*>(b + k + L);
  }
  if (k + L <= K) {
    s0 += *reinterpret_cast<const vec*>(a + k) * *reinterpret_cast<const vec*>(b + k);
    k += L;
  }
  s0 += s1;
  T acc = 0;
  for (int i = 0; i < L; ++i) acc += s0[i];
  for (; k < K; ++k) acc += a[k] * b[k];
  return acc;
}

template <typename scalar_t, typename index_t>
void sddmm_dot_run(const index_t* ip, const index_t* col, const index_t* pm, int64_t rows,
                   int64_t nnz, const scalar_t* pa, const scalar_t* pb, int64_t H, int64_t K,
                   bool b_shared, scalar_t* po, int64_t parts) {
  const int64_t F = H * K, FB = b_shared ? K : F, HB = b_shared ? 0 : K;
  const int64_t p = num_parts(parts, rows, nnz, F);
  for_each_part(p, ip, rows, nnz, [&](int64_t, Coord s, Coord e) {
    const int64_t last = std::min<int64_t>(e.row, rows - 1);
    for (int64_t r = s.row; r <= last; ++r) {
      const int64_t j0 = std::max<int64_t>(ip[r], s.nz);
      const int64_t j1 = std::min<int64_t>(ip[r + 1], e.nz);
      const scalar_t* __restrict ar = pa + r * F;
      for (int64_t j = j0; j < j1; ++j) {
        const scalar_t* __restrict br = pb + static_cast<int64_t>(col[j]) * FB;
        scalar_t* o = po + (pm ? static_cast<int64_t>(pm[j]) : j) * H;
        for (int64_t h = 0; h < H; ++h) o[h] = dot(ar + h * K, br + h * HB, K);
      }
    }
  });
}

at::Tensor sddmm_dot_csr(const at::Tensor& indptr, const at::Tensor& indices,
                         const c10::optional<at::Tensor>& perm, const at::Tensor& a,
                         const at::Tensor& b, int64_t parts) {
  const char* name = "granii::sddmm_dot_csr";
  check_csr(indptr, indices, name);
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3, name, ": a and b must be (n, H, K)");
  const auto dtype = a.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, name, ": float32 or float64 expected");
  check_dense(a, "a", name, dtype);
  check_dense(b, "b", name, dtype);
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  const int64_t H = a.size(1), K = a.size(2);
  TORCH_CHECK(a.size(0) == rows && (b.size(1) == H || b.size(1) == 1) && b.size(2) == K, name,
              ": a must be (rows, H, K) and b (n_cols, H, K) or (n_cols, 1, K)");
  if (perm) {
    TORCH_CHECK(perm->scalar_type() == indices.scalar_type() && perm->is_contiguous() &&
                    perm->numel() == nnz,
                name, ": perm must be a contiguous index vector of nnz entries");
  }
  auto out = at::empty({nnz, H}, a.options());
  if (nnz == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(dtype, "granii::sddmm_dot_csr", [&] {
    GRANII_DISPATCH_INDEX(indices.scalar_type(), "granii::sddmm_dot_csr", [&] {
      sddmm_dot_run<scalar_t, index_t>(indptr.data_ptr<index_t>(), indices.data_ptr<index_t>(),
                                       perm ? perm->data_ptr<index_t>() : nullptr, rows, nnz,
                                       a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), H, K,
                                       b.size(1) == 1 && H > 1, out.data_ptr<scalar_t>(), parts);
    });
  });
  return out;
}

int64_t parallel_threads() {
  int64_t seen = 1;
  at::parallel_for(0, 1 << 20, 1, [&](int64_t, int64_t) {
#ifdef _OPENMP
#pragma omp critical
    seen = std::max<int64_t>(seen, omp_get_num_threads());
#endif
  });
  return seen;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def(
      "spmm_csr(Tensor indptr, Tensor indices, Tensor x, Tensor? val=None, "
      "Tensor? val_perm=None, Tensor? row_scale=None, Tensor? col_scale=None, "
      "Tensor? bias=None, int act=0, int parts=0, Tensor? res=None) -> Tensor");
  m.def(
      "sddmm_dot_csr(Tensor indptr, Tensor indices, Tensor? perm, Tensor a, Tensor b, "
      "int parts=0) -> Tensor");
  m.def("parallel_threads() -> int", &parallel_threads);
  m.def("serial_work() -> int", &serial_work);
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("spmm_csr", &spmm_csr);
  m.impl("sddmm_dot_csr", &sddmm_dot_csr);
}

}  // namespace granii
