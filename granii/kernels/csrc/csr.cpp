// Index structures built once per graph (each sampled block is a new graph, so once per block).
//
//   granii::csr_transpose(indptr, indices, eids, n_cols) -> (t_indptr, t_indices, t_eids, t_pos)
//       The CSR of A^T from the CSR of A (rows x n_cols): a counting sort of the entries by
//       column. Row c of the result lists the rows r with an entry (r, c), ascending in r;
//       t_eids[k] is the edge id of that entry (eids[j], or j itself when eids is None) and
//       t_pos[k] its position j in A's CSR. Same integer type as the input. Serial: two passes
//       over nnz and one over the columns, a fraction of one aggregation over the same edges.
//   granii::csr_narrow(indptr, indices, eids, n_cols, small)
//           -> (indptr, indices, eids, col_counts, row_counts)
//       DGL's CSR (int64) in the kernels' index type (int32 when `small`), with eids undefined
//       when entry j is edge j, and the number of entries of each column and of each row as
//       float32 (out- and in-degrees when A is the in-edge index): one serial pass, where the
//       same in torch ops (casts, an identity check, a bincount) costs several parallel regions.
#include "native.h"

#include <torch/library.h>

#include <tuple>
#include <vector>

namespace granii {
namespace {

template <typename index_t>
void transpose(const index_t* indptr, const index_t* indices, const index_t* eids, int64_t rows,
               int64_t n_cols, index_t* t_indptr, index_t* t_indices, index_t* t_eids,
               index_t* t_pos) {
  std::fill(t_indptr, t_indptr + n_cols + 1, index_t(0));
  const int64_t nnz = indptr[rows];
  for (int64_t j = 0; j < nnz; ++j) ++t_indptr[indices[j] + 1];
  for (int64_t c = 0; c < n_cols; ++c) t_indptr[c + 1] += t_indptr[c];
  std::vector<index_t> next(t_indptr, t_indptr + n_cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = indptr[r]; j < indptr[r + 1]; ++j) {
      const index_t k = next[indices[j]]++;
      t_indices[k] = static_cast<index_t>(r);
      t_eids[k] = eids ? eids[j] : static_cast<index_t>(j);
      t_pos[k] = static_cast<index_t>(j);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> csr_transpose(
    const at::Tensor& indptr, const at::Tensor& indices, const c10::optional<at::Tensor>& eids,
    int64_t n_cols) {
  const char* name = "granii::csr_transpose";
  check_csr(indptr, indices, name);
  TORCH_CHECK(n_cols >= 0, name, ": n_cols must be non-negative");
  const int64_t rows = indptr.numel() - 1;
  const auto itype = indptr.scalar_type();
  TORCH_CHECK(itype == at::kInt || itype == at::kLong, name, ": int32 or int64 indices expected");
  const bool has_eids = eids.has_value() && eids->defined();
  if (has_eids) {
    TORCH_CHECK(eids->scalar_type() == itype && eids->is_contiguous() &&
                    eids->numel() == indices.numel(),
                name, ": eids must be contiguous, of the indices' type and one per entry");
  }
  auto opts = indptr.options();
  at::Tensor t_indptr = at::empty({n_cols + 1}, opts);
  at::Tensor t_indices = at::empty({indices.numel()}, opts);
  at::Tensor t_eids = at::empty({indices.numel()}, opts);
  at::Tensor t_pos = at::empty({indices.numel()}, opts);
  AT_DISPATCH_INDEX_TYPES(itype, "granii::csr_transpose", [&] {
    const index_t* ip = indptr.data_ptr<index_t>();
    TORCH_CHECK(ip[0] == 0 && ip[rows] == indices.numel(), name,
                ": indptr must start at 0 and end at the number of entries");
    const index_t* ix = indices.data_ptr<index_t>();
    for (int64_t j = 0; j < indices.numel(); ++j) {
      TORCH_CHECK(ix[j] >= 0 && ix[j] < n_cols, name, ": column index ", ix[j],
                  " outside [0, ", n_cols, ")");
    }
    transpose<index_t>(ip, ix, has_eids ? eids->data_ptr<index_t>() : nullptr, rows, n_cols,
                       t_indptr.data_ptr<index_t>(), t_indices.data_ptr<index_t>(),
                       t_eids.data_ptr<index_t>(), t_pos.data_ptr<index_t>());
  });
  return {t_indptr, t_indices, t_eids, t_pos};
}

template <typename out_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> narrow_to(
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& eids, int64_t n_cols,
    const char* name) {
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  auto opts = indptr.options().dtype(c10::CppTypeToScalarType<out_t>::value);
  at::Tensor ip = at::empty({rows + 1}, opts), ix = at::empty({nnz}, opts);
  at::Tensor ei = at::empty({nnz}, opts);
  at::Tensor counts = at::empty({n_cols}, indptr.options().dtype(at::kFloat));
  at::Tensor row_counts = at::empty({rows}, indptr.options().dtype(at::kFloat));
  float* rc = row_counts.data_ptr<float>();
  const int64_t* ip_in = indptr.data_ptr<int64_t>();
  const int64_t* ix_in = indices.data_ptr<int64_t>();
  const int64_t* ei_in = eids.data_ptr<int64_t>();
  out_t* ip_out = ip.data_ptr<out_t>();
  out_t* ix_out = ix.data_ptr<out_t>();
  out_t* ei_out = ei.data_ptr<out_t>();
  float* cnt = counts.data_ptr<float>();
  std::fill(cnt, cnt + n_cols, 0.0f);
  TORCH_CHECK(ip_in[0] == 0 && ip_in[rows] == nnz, name,
              ": indptr must start at 0 and end at the number of entries");
  for (int64_t r = 0; r <= rows; ++r) ip_out[r] = static_cast<out_t>(ip_in[r]);
  for (int64_t r = 0; r < rows; ++r) rc[r] = static_cast<float>(ip_in[r + 1] - ip_in[r]);
  bool ident = true;
  for (int64_t j = 0; j < nnz; ++j) {
    const int64_t c = ix_in[j];
    TORCH_CHECK(c >= 0 && c < n_cols, name, ": column index ", c, " outside [0, ", n_cols, ")");
    ix_out[j] = static_cast<out_t>(c);
    ei_out[j] = static_cast<out_t>(ei_in[j]);
    ident = ident && ei_in[j] == j;
    cnt[c] += 1.0f;
  }
  return {ip, ix, ident ? at::Tensor() : ei, counts, row_counts};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> csr_narrow(
    const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& eids, int64_t n_cols,
    bool small) {
  const char* name = "granii::csr_narrow";
  check_csr(indptr, indices, name);
  TORCH_CHECK(indptr.scalar_type() == at::kLong && eids.scalar_type() == at::kLong, name,
              ": int64 indices expected");
  TORCH_CHECK(eids.is_contiguous() && eids.numel() == indices.numel(), name,
              ": eids must be contiguous, one per entry");
  TORCH_CHECK(n_cols >= 0, name, ": n_cols must be non-negative");
  return small ? narrow_to<int32_t>(indptr, indices, eids, n_cols, name)
               : narrow_to<int64_t>(indptr, indices, eids, n_cols, name);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("csr_transpose(Tensor indptr, Tensor indices, Tensor? eids, int n_cols) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("csr_narrow(Tensor indptr, Tensor indices, Tensor eids, int n_cols, bool small) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("csr_transpose", &csr_transpose);
  m.impl("csr_narrow", &csr_narrow);
}

}  // namespace granii
