// Shared helpers of granii's native CPU kernels (granii/kernels/csrc/*.cpp).
//
// Conventions (as in granii/kernels/__init__.py): a CSR matrix is (indptr, indices) with one row
// per output row; for A (num_dst x num_src) rows are destinations and indices sources, for A^T the
// other way round. indptr and indices share one integer type: int32 when every index and the edge
// count fit, else int64. Dense operands are contiguous (n, H, K): H heads of K features each.
//
// Parallel loops go through at::parallel_for (torch's own OpenMP pool): the thread count set by
// torch.set_num_threads is honoured at each call, and with one thread (DataLoader workers) no
// OpenMP region is entered at all.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace granii {

// ---- dispatch over the index type of a CSR -----------------------------------------------------
#define GRANII_DISPATCH_INDEX(TYPE, NAME, ...)                                         \
  [&] {                                                                                \
    if ((TYPE) == at::kInt) {                                                          \
      using index_t = int32_t;                                                         \
      return __VA_ARGS__();                                                            \
    }                                                                                  \
    TORCH_CHECK((TYPE) == at::kLong, NAME, ": CSR indices must be int32 or int64");   \
    using index_t = int64_t;                                                           \
    return __VA_ARGS__();                                                              \
  }()

// ---- work partition by merge path --------------------------------------------------------------
// The work of a CSR product is one step per nonzero (gather a row of X) plus one per output row
// (write it). Splitting the merged sequence of row ends and nonzeros into equal pieces balances
// both, whatever the degree skew: a row longer than a piece is split between parts, whose partial
// sums are added afterwards (at most two partial rows per part). See Merrill & Garland,
// "Merge-based parallel sparse matrix-vector multiplication", SC 2016.
struct Coord {
  int64_t row;   // rows whose end is consumed before this point
  int64_t nz;    // nonzeros consumed before this point
};

template <typename index_t>
inline Coord merge_path_search(int64_t diagonal, const index_t* indptr, int64_t rows, int64_t nnz) {
  // row ends a_i = indptr[i + 1], nonzeros b_j = j; a row end comes first when a_i <= b_j
  int64_t lo = std::max<int64_t>(diagonal - nnz, 0);
  int64_t hi = std::min<int64_t>(diagonal, rows);
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(indptr[mid + 1]) <= diagonal - mid - 1) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return {lo, diagonal - lo};
}

// Work (multiply-adds, or (rows + nonzeros) x width) below which a kernel runs on the calling
// thread. A parallel region wakes torch's OpenMP workers: about 5 us while they still spin after
// the last region (libgomp's default), 35-50 us when they sleep at once (OMP_WAIT_POLICY=PASSIVE,
// the benchmark's setting on this 2-core machine), more than a whole Cora-sized SpMM takes on
// one thread (measured, Cora k = 32: 28 us on one thread, 60 us split in two under PASSIVE, 17 us
// split in two with spinning workers; PubMed k = 16, 2 M: 299 against 186 us either way).
// The variable is read as libgomp reads it (and granii/kernels/blas.py): case and surrounding
// spaces ignored.
inline int64_t serial_work() {
  static const int64_t work = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    std::string p;
    for (const char* c = policy ? policy : ""; *c; ++c) {
      if (!std::isspace(static_cast<unsigned char>(*c)))
        p += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
    return p == "passive" ? int64_t{1} << 20 : int64_t{1} << 15;
  }();
  return work;
}

// Number of parts: `requested` if positive (tests use it to force splits), else the thread count;
// one part when the whole product is too small for a parallel region to pay.
inline int64_t num_parts(int64_t requested, int64_t rows, int64_t nnz, int64_t width) {
  if (requested > 0) return requested;
  const int64_t work = (rows + nnz) * std::max<int64_t>(width, 1);
  if (work < serial_work()) return 1;
  return std::max<int64_t>(1, at::get_num_threads());
}

// Runs body(part, Coord begin, Coord end) for each part of the merge path, in parallel.
template <typename index_t, typename Body>
inline void for_each_part(int64_t parts, const index_t* indptr, int64_t rows, int64_t nnz,
                          const Body& body) {
  const int64_t total = rows + nnz;
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Coord a = merge_path_search(total * p / parts, indptr, rows, nnz);
      const Coord b = merge_path_search(total * (p + 1) / parts, indptr, rows, nnz);
      body(p, a, b);
    }
  });
}

// ---- argument checks ----------------------------------------------------------------------------
inline void check_csr(const at::Tensor& indptr, const at::Tensor& indices, const char* name) {
  TORCH_CHECK(indptr.dim() == 1 && indptr.numel() >= 1, name, ": indptr must be 1-D, non-empty");
  TORCH_CHECK(indices.dim() == 1, name, ": indices must be 1-D");
  TORCH_CHECK(indptr.scalar_type() == indices.scalar_type(), name,
              ": indptr and indices must have the same integer type");
  TORCH_CHECK(indptr.is_contiguous() && indices.is_contiguous(), name,
              ": indptr and indices must be contiguous");
  TORCH_CHECK(indptr.device().is_cpu() && indices.device().is_cpu(), name,
              ": CPU tensors expected");
}

inline void check_dense(const at::Tensor& t, const char* what, const char* name,
                        at::ScalarType dtype) {
  TORCH_CHECK(t.is_contiguous(), name, ": ", what, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, ": ", what, " has dtype ", t.scalar_type(),
              ", expected ", dtype);
  TORCH_CHECK(t.device().is_cpu(), name, ": ", what, " must be a CPU tensor");
}

}  // namespace granii
