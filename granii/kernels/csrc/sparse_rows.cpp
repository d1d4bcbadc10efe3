// GEMM whose left operand is mostly zeros (bag-of-words node features): Y = X W (+ C) reading
// only the nonzeros of X, and the weight gradient X^T G from what the forward kept.
//
//   granii::row_density(x, samples, stop) -> float
//       Fraction of nonzero entries in `samples` rows of x (n, k) spread evenly over it; the count
//       stops as soon as the fraction is sure to exceed `stop` (a dense x costs one row), and
//       what it returns then is above `stop`.
//   granii::sparse_rows_mm(x, w, c) -> (y, indptr, indices, values)
//       x (n, k), w (k, m), c None, (m,) or (n, m). Each row of x is scanned once (blocks of
//       zeros are skipped a vector at a time); its nonzeros x_ij are kept as a CSR (int64 indptr,
//       int64 column indices, values) and y[i] = c[i] + sum_j x_ij w[j], one axpy of w's row j
//       per nonzero. Cost: one read of x plus nnz(x) m multiply-adds, against n k m for a dense
//       GEMM.
//   granii::sparse_rows_mm_wgrad(indptr, indices, values, g, k) -> (k, m)
//       dW = X^T G from the CSR of X: transposed once (a counting sort of the nonzeros by
//       column, rows ascending in each), then dW[j] = sum_{i : x_ij != 0} x_ij g[i], one output
//       row per column of x: no write conflicts, the same sums in the same order whatever the
//       thread count.
//
// A zero of x is skipped, so 0 * inf in w gives 0 here where a dense GEMM gives NaN.
#include "native.h"

#include <torch/library.h>

#include <immintrin.h>

#include <vector>

namespace granii {
namespace {

constexpr int64_t kBlock = 16;

template <typename scalar_t>
inline bool is_nonzero(scalar_t v) {
  return !(v == scalar_t(0));
}

// Bit t set when x[t] is nonzero (NaN counts as nonzero, -0.0 as zero), for the kBlock values at
// x: one vector compare per 16 floats where the compiler targets AVX-512 or AVX2, else a loop.
// The caller walks the set bits, so a block of zeros costs one compare.
template <typename scalar_t>
inline uint32_t nonzero_mask_loop(const scalar_t* x) {
  uint32_t mask = 0;
  for (int64_t t = 0; t < kBlock; ++t) mask |= static_cast<uint32_t>(is_nonzero(x[t])) << t;
  return mask;
}

inline uint32_t nonzero_mask(const float* x) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
#elif defined(__AVX__)
  const __m256 zero = _mm256_setzero_ps();
  const uint32_t lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), zero, _CMP_NEQ_UQ));
  const uint32_t hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8), zero, _CMP_NEQ_UQ));
  return lo | (hi << 8);
#else
  return nonzero_mask_loop(x);
#endif
}

inline uint32_t nonzero_mask(const double* x) {
#if defined(__AVX512F__)
  const __m512d zero = _mm512_setzero_pd();
  const uint32_t lo = _mm512_cmp_pd_mask(_mm512_loadu_pd(x), zero, _CMP_NEQ_UQ);
  const uint32_t hi = _mm512_cmp_pd_mask(_mm512_loadu_pd(x + 8), zero, _CMP_NEQ_UQ);
  return lo | (hi << 8);
#else
  return nonzero_mask_loop(x);
#endif
}

double row_density(const at::Tensor& x, int64_t samples, double stop) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "row_density: x must be a contiguous 2-D CPU tensor");
  const int64_t n = x.size(0), k = x.size(1);
  if (n == 0 || k == 0) return 0.0;
  const int64_t rows = std::min<int64_t>(std::max<int64_t>(samples, 1), n);
  int64_t nonzero = 0;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "row_density", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int64_t s = 0; s < rows; ++s) {
      const scalar_t* r = xp + (s * n / rows) * k;
      int64_t c = 0;
      int64_t j = 0;
      for (; j + kBlock <= k; j += kBlock) c += __builtin_popcount(nonzero_mask(r + j));
      for (; j < k; ++j) c += is_nonzero(r[j]);
      nonzero += c;
      if (static_cast<double>(nonzero) > stop * static_cast<double>(rows * k)) break;
    }
  });
  return static_cast<double>(nonzero) / static_cast<double>(rows * k);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sparse_rows_mm(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& c) {
  const char* name = "sparse_rows_mm";
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(0), name,
              ": expected x (n, k) and w (k, m), got ", x.sizes(), " and ", w.sizes());
  check_dense(x, "x", name, x.scalar_type());
  check_dense(w, "w", name, x.scalar_type());
  const int64_t n = x.size(0), k = x.size(1), m = w.size(1);
  bool c_each_row = false;
  if (c.has_value()) {
    check_dense(*c, "c", name, x.scalar_type());
    c_each_row = c->dim() == 2 && c->size(0) == n && c->size(1) == m;
    TORCH_CHECK(c_each_row || (c->dim() == 1 && c->size(0) == m), name,
                ": c must be (m,) or (n, m), got ", c->sizes());
  }
  at::Tensor y = at::empty({n, m}, x.options());
  at::Tensor indptr = at::empty({n + 1}, x.options().dtype(at::kLong));
  at::Tensor indices, values;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts =
      n * k < serial_work() ? 1 : std::max<int64_t>(1, std::min<int64_t>(n, 4 * threads));
  std::vector<std::vector<int64_t>> cols(parts);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "sparse_rows_mm", [&] {
    std::vector<std::vector<scalar_t>> vals(parts);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const scalar_t* cp = c.has_value() ? c->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    int64_t* ip = indptr.data_ptr<int64_t>();
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        auto& pc = cols[p];
        auto& pv = vals[p];
        const int64_t r0 = n * p / parts, r1 = n * (p + 1) / parts;
        pc.reserve((r1 - r0) * std::max<int64_t>(k / 32, 1));
        pv.reserve((r1 - r0) * std::max<int64_t>(k / 32, 1));
        for (int64_t i = r0; i < r1; ++i) {
          const scalar_t* xr = xp + i * k;
          scalar_t* __restrict yr = yp + i * m;
          if (cp) {
            const scalar_t* cr = cp + (c_each_row ? i * m : 0);
            for (int64_t o = 0; o < m; ++o) yr[o] = cr[o];
          } else {
            for (int64_t o = 0; o < m; ++o) yr[o] = scalar_t(0);
          }
          const size_t before = pc.size();
          auto take = [&](int64_t t) {
            const scalar_t v = xr[t];
            const scalar_t* __restrict wr = wp + t * m;
            for (int64_t o = 0; o < m; ++o) yr[o] += v * wr[o];
            pc.push_back(t);
            pv.push_back(v);
          };
          int64_t j = 0;
          for (; j + kBlock <= k; j += kBlock) {
            for (uint32_t mask = nonzero_mask(xr + j); mask; mask &= mask - 1) {
              take(j + __builtin_ctz(mask));
            }
          }
          for (; j < k; ++j) {
            if (is_nonzero(xr[j])) take(j);
          }
          ip[i + 1] = static_cast<int64_t>(pc.size() - before);
        }
      }
    });
    ip[0] = 0;
    for (int64_t i = 0; i < n; ++i) ip[i + 1] += ip[i];
    indices = at::empty({ip[n]}, x.options().dtype(at::kLong));
    values = at::empty({ip[n]}, x.options());
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t first = ip[n * p / parts];
      std::copy(cols[p].begin(), cols[p].end(), indices.data_ptr<int64_t>() + first);
      std::copy(vals[p].begin(), vals[p].end(), values.data_ptr<scalar_t>() + first);
    }
  });
  return std::make_tuple(y, indptr, indices, values);
}

at::Tensor sparse_rows_mm_wgrad(const at::Tensor& indptr, const at::Tensor& indices,
                                const at::Tensor& values, const at::Tensor& g, int64_t k) {
  const char* name = "sparse_rows_mm_wgrad";
  check_csr(indptr, indices, name);
  TORCH_CHECK(indptr.scalar_type() == at::kLong, name, ": int64 CSR expected");
  TORCH_CHECK(g.dim() == 2 && g.size(0) == indptr.numel() - 1, name,
              ": g must be (n, m) with n the rows of the CSR");
  check_dense(g, "g", name, g.scalar_type());
  check_dense(values, "values", name, g.scalar_type());
  const int64_t n = g.size(0), m = g.size(1), nnz = indices.numel();
  TORCH_CHECK(values.numel() == nnz, name, ": one value per index expected");
  const int64_t* ip = indptr.data_ptr<int64_t>();
  const int64_t* col = indices.data_ptr<int64_t>();
  std::vector<int64_t> start(k + 1, 0), row(nnz), slot(nnz);
  for (int64_t q = 0; q < nnz; ++q) {
    TORCH_CHECK(col[q] >= 0 && col[q] < k, name, ": column index out of range");
    ++start[col[q] + 1];
  }
  for (int64_t j = 0; j < k; ++j) start[j + 1] += start[j];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t q = ip[i]; q < ip[i + 1]; ++q) {
        const int64_t s = next[col[q]]++;
        row[s] = i;
        slot[s] = q;
      }
    }
  }
  at::Tensor dw = at::empty({k, m}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "sparse_rows_mm_wgrad", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* vp = values.data_ptr<scalar_t>();
    scalar_t* dp = dw.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, serial_work() / 2 / std::max<int64_t>(m, 1));
    at::parallel_for(0, k, grain, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        scalar_t* dr = dp + j * m;
        for (int64_t o = 0; o < m; ++o) dr[o] = scalar_t(0);
        for (int64_t s = start[j]; s < start[j + 1]; ++s) {
          const scalar_t v = vp[slot[s]];
          const scalar_t* gr = gp + row[s] * m;
          for (int64_t o = 0; o < m; ++o) dr[o] += v * gr[o];
        }
      }
    });
  });
  return dw;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("row_density(Tensor x, int samples, float stop=1.0) -> float", &row_density);
  m.def("sparse_rows_mm(Tensor x, Tensor w, Tensor? c=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sparse_rows_mm_wgrad(Tensor indptr, Tensor indices, Tensor values, Tensor g, int k) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("sparse_rows_mm", &sparse_rows_mm);
  m.impl("sparse_rows_mm_wgrad", &sparse_rows_mm_wgrad);
}

}  // namespace granii
