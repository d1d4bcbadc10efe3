// Typed linear over rows sorted by relation (RelGraphConv, HGT): one call for every relation.
//
//   granii::segment_mm(x, w, seglen) -> y
//       x (rows, k_in), w (R, k_in, k_out), seglen (R,) int64 with sum(seglen) == rows: the rows
//       of segment r are multiplied by w[r], y[i] = x[i] w[r(i)]. Segments are cut into pieces of
//       at most kPiece rows, the pieces shared out by one parallel loop; in a piece, four rows at
//       a time run against column tiles of w (64 down to 8 columns) whose accumulators stay in
//       registers, so each row of w read serves four rows of x. One parallel region in all,
//       where a loop of per-relation GEMMs enters one per relation (about 0.1 ms each when
//       OpenMP workers sleep between regions).
//   granii::segment_mm_wgrad(x, g, seglen) -> dw (R, k_in, k_out)
//       dw[r] = x_r^T g_r. Each segment is cut into pieces whose length depends on the shapes
//       alone; the first piece of a segment accumulates into dw[r], the others into buffers
//       added to it afterwards in piece order, so the sums are the same whatever the thread
//       count. An empty segment gives zeros.
//
// The backward of y = segment_mm(x, w) is dx = segment_mm(g, w^T) and dw = segment_mm_wgrad(x, g).
#include "native.h"

#include <torch/library.h>

#include <ATen/ops/zeros.h>

#include <vector>

namespace granii {
namespace {

constexpr int64_t kPiece = 256;      // rows of a forward piece

struct Piece {
  int64_t seg, begin, end;
};

std::vector<int64_t> offsets_of(const at::Tensor& seglen, int64_t rows, const char* name) {
  TORCH_CHECK(seglen.dim() == 1 && seglen.scalar_type() == at::kLong && seglen.device().is_cpu(),
              name, ": seglen must be a 1-D int64 CPU tensor");
  const auto lens = seglen.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> off(lens.numel() + 1, 0);
  for (int64_t r = 0; r < lens.numel(); ++r) {
    TORCH_CHECK(lp[r] >= 0, name, ": negative segment length");
    off[r + 1] = off[r] + lp[r];
  }
  TORCH_CHECK(off.back() == rows, name, ": seglen sums to ", off.back(), " but x has ", rows,
              " rows");
  return off;
}

std::vector<Piece> pieces_of(const std::vector<int64_t>& off, int64_t piece) {
  std::vector<Piece> out;
  for (int64_t r = 0; r + 1 < static_cast<int64_t>(off.size()); ++r) {
    for (int64_t a = off[r]; a < off[r + 1]; a += piece) {
      out.push_back({r, a, std::min(a + piece, off[r + 1])});
    }
  }
  return out;
}

// One register per vector (GCC vector extensions): 64 bytes with AVX-512 (32 zmm registers),
// 32 bytes otherwise (16 ymm with AVX2). Each tile's accumulators, the vectors it reads and the
// broadcast fit the register file (kTile4: rows of the tile of 4 vectors, kOuterRows: rows of
// the weight gradient's tile): a 64-byte vector on AVX2 is two registers, and tiles sized for
// AVX-512 spill there (measured 10-30x slower).
#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int64_t kTile4 = 4, kOuterRows = 8;
#else
constexpr int kVecBytes = 32;
constexpr int64_t kTile4 = 2, kOuterRows = 4;
#endif
typedef float vfloat __attribute__((vector_size(kVecBytes)));
typedef double vdouble __attribute__((vector_size(kVecBytes)));
template <typename scalar_t> struct Vec;
template <> struct Vec<float> { using type = vfloat; };
template <> struct Vec<double> { using type = vdouble; };

template <typename V>
inline V load(const void* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void store(void* p, const V& v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

// y[i:i+RB, c0:c0+NV*L] = x[i:i+RB] w[:, c0:...] with RB x NV vector accumulators in registers:
// each vector of w read serves RB rows
template <typename scalar_t, int64_t RB, int64_t NV>
inline void vtile(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t i, int64_t k_in,
                  int64_t k_out, int64_t c0) {
  using V = typename Vec<scalar_t>::type;
  constexpr int64_t L = sizeof(V) / sizeof(scalar_t);
  V acc[RB][NV];
  for (int64_t q = 0; q < RB; ++q)
    for (int64_t v = 0; v < NV; ++v) acc[q][v] = V{};
  for (int64_t j = 0; j < k_in; ++j) {
    V wv[NV];
    for (int64_t v = 0; v < NV; ++v) wv[v] = load<V>(w + j * k_out + c0 + v * L);
    for (int64_t q = 0; q < RB; ++q) {
      const V xv = V{} + x[(i + q) * k_in + j];
      for (int64_t v = 0; v < NV; ++v) acc[q][v] += xv * wv[v];
    }
  }
  for (int64_t q = 0; q < RB; ++q)
    for (int64_t v = 0; v < NV; ++v) store(y + (i + q) * k_out + c0 + v * L, acc[q][v]);
}

// columns [c0, c0 + NV L) of rows [a, b)
template <typename scalar_t, int64_t RB, int64_t NV>
inline void vcols(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t a, int64_t b,
                  int64_t k_in, int64_t k_out, int64_t c0) {
  int64_t i = a;
  for (; i + RB <= b; i += RB) vtile<scalar_t, RB, NV>(x, w, y, i, k_in, k_out, c0);
  for (; i < b; ++i) vtile<scalar_t, 1, NV>(x, w, y, i, k_in, k_out, c0);
}

// the columns left over after the vectors: plain loops
template <typename scalar_t>
inline void scols(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t a, int64_t b,
                  int64_t k_in, int64_t k_out, int64_t c0) {
  for (int64_t i = a; i < b; ++i) {
    for (int64_t c = c0; c < k_out; ++c) y[i * k_out + c] = 0;
    for (int64_t j = 0; j < k_in; ++j) {
      const scalar_t xv = x[i * k_in + j];
      for (int64_t c = c0; c < k_out; ++c) y[i * k_out + c] += xv * w[j * k_out + c];
    }
  }
}

template <typename scalar_t>
void rows_times(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t a, int64_t b,
                int64_t k_in, int64_t k_out) {
  constexpr int64_t L = sizeof(typename Vec<scalar_t>::type) / sizeof(scalar_t);
  int64_t c = 0;
  for (; c + 4 * L <= k_out; c += 4 * L) vcols<scalar_t, kTile4, 4>(x, w, y, a, b, k_in, k_out, c);
  if (c + 2 * L <= k_out) { vcols<scalar_t, 6, 2>(x, w, y, a, b, k_in, k_out, c); c += 2 * L; }
  if (c + L <= k_out) { vcols<scalar_t, 8, 1>(x, w, y, a, b, k_in, k_out, c); c += L; }
  if (c < k_out) scols(x, w, y, a, b, k_in, k_out, c);
}

void check_dense(const at::Tensor& t, int64_t dim, const char* name, const char* what) {
  TORCH_CHECK(t.dim() == dim && t.device().is_cpu(), name, ": ", what, " must be a ", dim,
              "-D CPU tensor");
}

at::Tensor segment_mm(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& seglen) {
  check_dense(x_, 2, "segment_mm", "x");
  check_dense(w_, 3, "segment_mm", "w");
  TORCH_CHECK(x_.scalar_type() == w_.scalar_type(), "segment_mm: x and w differ in dtype");
  TORCH_CHECK(w_.size(1) == x_.size(1), "segment_mm: x has ", x_.size(1), " columns, w ",
              w_.size(1), " rows");
  TORCH_CHECK(w_.size(0) == seglen.numel(), "segment_mm: ", w_.size(0), " weights for ",
              seglen.numel(), " segments");
  const auto x = x_.contiguous();
  const auto w = w_.contiguous();
  const int64_t rows = x.size(0), k_in = x.size(1), k_out = w.size(2);
  const auto off = offsets_of(seglen, rows, "segment_mm");
  auto y = at::empty({rows, k_out}, x.options());
  if (rows == 0 || k_out == 0) return y;
  if (k_in == 0) return y.zero_();
  const auto pieces = pieces_of(off, kPiece);
  // pieces per thread at least: one parallel region pays for about 32K multiply-adds
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (kPiece * k_in * k_out));
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "segment_mm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), grain, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const Piece& pc = pieces[p];
        rows_times(xp, wp + pc.seg * k_in * k_out, yp, pc.begin, pc.end, k_in, k_out);
      }
    });
  });
  return y;
}

// acc[:, c0:c0+NV L] += x[i:i+RB]^T g[i:i+RB, c0:...]: the RB x NV vectors of g stay in
// registers while each row j of acc is read and written once for RB rows
template <typename scalar_t, int64_t RB, int64_t NV>
inline void outer_tile(const scalar_t* x, const scalar_t* g, scalar_t* acc, int64_t i,
                       int64_t k_in, int64_t k_out, int64_t c0) {
  using V = typename Vec<scalar_t>::type;
  constexpr int64_t L = sizeof(V) / sizeof(scalar_t);
  V gv[RB][NV];
  for (int64_t q = 0; q < RB; ++q)
    for (int64_t v = 0; v < NV; ++v) gv[q][v] = load<V>(g + (i + q) * k_out + c0 + v * L);
  for (int64_t j = 0; j < k_in; ++j) {
    V a[NV];
    for (int64_t v = 0; v < NV; ++v) a[v] = load<V>(acc + j * k_out + c0 + v * L);
    for (int64_t q = 0; q < RB; ++q) {
      const V xv = V{} + x[(i + q) * k_in + j];
      for (int64_t v = 0; v < NV; ++v) a[v] += xv * gv[q][v];
    }
    for (int64_t v = 0; v < NV; ++v) store(acc + j * k_out + c0 + v * L, a[v]);
  }
}

template <typename scalar_t, int64_t RB, int64_t NV>
inline void outer_cols(const scalar_t* x, const scalar_t* g, scalar_t* acc, int64_t a, int64_t b,
                       int64_t k_in, int64_t k_out, int64_t c0) {
  int64_t i = a;
  for (; i + RB <= b; i += RB) outer_tile<scalar_t, RB, NV>(x, g, acc, i, k_in, k_out, c0);
  for (; i < b; ++i) outer_tile<scalar_t, 1, NV>(x, g, acc, i, k_in, k_out, c0);
}

// acc (k_in, k_out) += x[a:b]^T g[a:b]
template <typename scalar_t>
void accumulate_outer(const scalar_t* x, const scalar_t* g, scalar_t* acc, int64_t a, int64_t b,
                      int64_t k_in, int64_t k_out) {
  constexpr int64_t L = sizeof(typename Vec<scalar_t>::type) / sizeof(scalar_t);
  int64_t c = 0;
  for (; c + 2 * L <= k_out; c += 2 * L)
    outer_cols<scalar_t, kOuterRows, 2>(x, g, acc, a, b, k_in, k_out, c);
  if (c + L <= k_out) { outer_cols<scalar_t, 8, 1>(x, g, acc, a, b, k_in, k_out, c); c += L; }
  if (c == k_out) return;
  for (int64_t i = a; i < b; ++i) {         // the columns left over after the vectors
    for (int64_t j = 0; j < k_in; ++j) {
      const scalar_t xv = x[i * k_in + j];
      for (int64_t t = c; t < k_out; ++t) acc[j * k_out + t] += xv * g[i * k_out + t];
    }
  }
}

at::Tensor segment_mm_wgrad(const at::Tensor& x_, const at::Tensor& g_, const at::Tensor& seglen) {
  check_dense(x_, 2, "segment_mm_wgrad", "x");
  check_dense(g_, 2, "segment_mm_wgrad", "g");
  TORCH_CHECK(x_.scalar_type() == g_.scalar_type(), "segment_mm_wgrad: x and g differ in dtype");
  TORCH_CHECK(x_.size(0) == g_.size(0), "segment_mm_wgrad: x and g differ in rows");
  const auto x = x_.contiguous();
  const auto g = g_.contiguous();
  const int64_t rows = x.size(0), k_in = x.size(1), k_out = g.size(1);
  const int64_t R = seglen.numel();
  const auto off = offsets_of(seglen, rows, "segment_mm_wgrad");
  auto dw = at::zeros({R, k_in, k_out}, x.options());
  if (rows == 0 || k_in == 0 || k_out == 0) return dw;
  // pieces long enough that their extra buffers stay small: at most 64 beyond one per segment
  const int64_t piece = std::max<int64_t>(512, (rows + 63) / 64);
  const auto pieces = pieces_of(off, piece);
  std::vector<int64_t> slot(pieces.size(), -1);      // -1: the segment's first piece, into dw
  int64_t extra = 0;
  for (size_t p = 0; p < pieces.size(); ++p) {
    if (pieces[p].begin != off[pieces[p].seg]) slot[p] = extra++;
  }
  auto buf = at::zeros({extra, k_in, k_out}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "segment_mm_wgrad", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* dp = dw.data_ptr<scalar_t>();
    scalar_t* bp = extra ? buf.data_ptr<scalar_t>() : nullptr;
    const int64_t kk = k_in * k_out;
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const Piece& pc = pieces[p];
        scalar_t* acc = slot[p] < 0 ? dp + pc.seg * kk : bp + slot[p] * kk;
        accumulate_outer(xp, gp, acc, pc.begin, pc.end, k_in, k_out);
      }
    });
    for (size_t p = 0; p < pieces.size(); ++p) {        // in piece order: deterministic sums
      if (slot[p] < 0) continue;
      scalar_t* out = dp + pieces[p].seg * kk;
      const scalar_t* in = bp + slot[p] * kk;
      for (int64_t t = 0; t < kk; ++t) out[t] += in[t];
    }
  });
  return dw;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("segment_mm(Tensor x, Tensor w, Tensor seglen) -> Tensor");
  m.def("segment_mm_wgrad(Tensor x, Tensor g, Tensor seglen) -> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("segment_mm", &segment_mm);
  m.impl("segment_mm_wgrad", &segment_mm_wgrad);
}

}  // namespace granii
