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
//   granii::coo_to_csr(src, dst, num_src, num_dst, small)
//           -> (indptr, indices, eids, out_degrees, in_degrees, stats)
//       A's CSR (a row per destination, ascending edge ids within it) from an edge list in edge-id
//       order, in the kernels' index type, with eids undefined when the edges are already in that
//       order; the degrees as float32; stats (float64): max in-degree, max out-degree and the
//       standard deviation of the in-degrees. One counting sort: what a new graph object (a
//       `dgl.batch` each step) needs before any kernel runs, where building it from DGL's index
//       costs an index build, a cast and a second pass.
//   granii::coo_to_csr_both(src, dst, num_src, num_dst, small)
//           -> (coo_to_csr's six, t_indptr, t_indices, t_eids, t_pos)
//       coo_to_csr and, in the same call, A^T as csr_transpose gives it: its row pointers from
//       the out-degrees that pass counted, its entries by one walk of A's rows, so the backward
//       of a new graph in training finds its index without a count of its own.
//   granii::batch_segments(counts, num_nodes) -> (offsets, offsets32, graph_of_node)
//       The segments of a batch of graphs from its node counts (int64, one per graph): their
//       running sums from 0 (G + 1 entries, int64, and the same as int32, the row pointers of
//       the readout's CSR R), and the graph of each node (N entries, int64: R^T as an index).
//       Checks that the counts are non-negative and add up to num_nodes. One pass, where the
//       same in torch ops (zeros, cumsum, a cast, a sum read back, repeat_interleave) costs a
//       readout on a batch of small graphs more than its sum.
#include "native.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

using CooOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename out_t>
CooOut coo_to(const int64_t* src, const int64_t* dst, int64_t nnz, int64_t num_src,
              int64_t num_dst, const at::TensorOptions& int_opts, const char* name,
              bool transpose) {
  auto opts = int_opts.dtype(c10::CppTypeToScalarType<out_t>::value);
  auto fopts = int_opts.dtype(at::kFloat);
  at::Tensor ip = at::empty({num_dst + 1}, opts), ix = at::empty({nnz}, opts);
  at::Tensor ei = at::empty({nnz}, opts);
  at::Tensor out_deg = at::empty({num_src}, fopts), in_deg = at::empty({num_dst}, fopts);
  at::Tensor stats = at::empty({3}, int_opts.dtype(at::kDouble));
  out_t* p = ip.data_ptr<out_t>();
  out_t* x = ix.data_ptr<out_t>();
  out_t* e = ei.data_ptr<out_t>();
  float* od = out_deg.data_ptr<float>();
  float* id = in_deg.data_ptr<float>();
  std::fill(p, p + num_dst + 1, out_t(0));
  // integer counts (a float increment is a four-cycle dependency when an id repeats), the
  // bounds and the order checked without a branch per edge; a bad edge is looked for after
  std::vector<out_t> out_count(num_src, out_t(0));
  out_t* oc = out_count.data();
  bool unsorted = false, bad = false;
  int64_t last = 0;
  for (int64_t j = 0; j < nnz; ++j) {
    const int64_t u = src[j], v = dst[j];
    bad |= static_cast<uint64_t>(u) >= static_cast<uint64_t>(num_src) ||
           static_cast<uint64_t>(v) >= static_cast<uint64_t>(num_dst);
    if (bad) break;
    ++p[v + 1];
    ++oc[u];
    unsorted |= v < last;
    last = v;
  }
  if (bad) {
    for (int64_t j = 0; j < nnz; ++j) {
      const int64_t u = src[j], v = dst[j];
      TORCH_CHECK(u >= 0 && u < num_src && v >= 0 && v < num_dst, name, ": edge ", j, " (", u,
                  ", ", v, ") outside the graph's ", num_src, " x ", num_dst, " nodes");
    }
  }
  const bool sorted = !unsorted;
  double max_in = 0.0, max_out = 0.0, sum = 0.0, sum_sq = 0.0;
  for (int64_t v = 0; v < num_dst; ++v) {
    const double d = static_cast<double>(p[v + 1]);
    id[v] = static_cast<float>(d);
    max_in = std::max(max_in, d);
    sum += d;
    sum_sq += d * d;
    p[v + 1] += p[v];
  }
  out_t top = 0;
  for (int64_t u = 0; u < num_src; ++u) {
    od[u] = static_cast<float>(oc[u]);
    top = std::max(top, oc[u]);
  }
  max_out = static_cast<double>(top);
  if (sorted) {
    for (int64_t j = 0; j < nnz; ++j) x[j] = static_cast<out_t>(src[j]);
  } else {
    std::vector<out_t> next(p, p + num_dst);
    for (int64_t j = 0; j < nnz; ++j) {
      const out_t k = next[dst[j]]++;
      x[k] = static_cast<out_t>(src[j]);
      e[k] = static_cast<out_t>(j);
    }
  }
  const double mean = num_dst ? sum / num_dst : 0.0;
  const double var = num_dst ? std::max(sum_sq / num_dst - mean * mean, 0.0) : 0.0;
  double* st = stats.data_ptr<double>();
  st[0] = max_in;
  st[1] = max_out;
  st[2] = std::sqrt(var);
  at::Tensor tp, tx, te, tpos;
  if (transpose) {  // A^T by its rows' counts (the out-degrees above), A's rows in order
    tp = at::empty({num_src + 1}, opts);
    tx = at::empty({nnz}, opts);
    te = at::empty({nnz}, opts);
    tpos = at::empty({nnz}, opts);
    out_t* q = tp.data_ptr<out_t>();
    out_t* qx = tx.data_ptr<out_t>();
    out_t* qe = te.data_ptr<out_t>();
    out_t* qp = tpos.data_ptr<out_t>();
    q[0] = 0;
    for (int64_t u = 0; u < num_src; ++u) q[u + 1] = q[u] + oc[u];
    std::vector<out_t> next(q, q + num_src);
    for (int64_t v = 0; v < num_dst; ++v) {
      for (out_t k = p[v]; k < p[v + 1]; ++k) {
        const out_t t = next[x[k]]++;
        qx[t] = static_cast<out_t>(v);
        qe[t] = sorted ? k : e[k];
        qp[t] = k;
      }
    }
  }
  return {ip, ix, sorted ? at::Tensor() : ei, out_deg, in_deg, stats, tp, tx, te, tpos};
}

CooOut coo_convert(const at::Tensor& src, const at::Tensor& dst, int64_t num_src,
                   int64_t num_dst, bool small, bool transpose, const char* name) {
  TORCH_CHECK(src.dim() == 1 && dst.dim() == 1 && src.numel() == dst.numel(), name,
              ": src and dst must be 1-d, one entry per edge");
  TORCH_CHECK(num_src >= 0 && num_dst >= 0, name, ": node counts must be non-negative");
  const at::Tensor s = src.to(at::kLong).contiguous(), d = dst.to(at::kLong).contiguous();
  const auto opts = s.options();
  return small ? coo_to<int32_t>(s.data_ptr<int64_t>(), d.data_ptr<int64_t>(), s.numel(), num_src,
                                 num_dst, opts, name, transpose)
               : coo_to<int64_t>(s.data_ptr<int64_t>(), d.data_ptr<int64_t>(), s.numel(), num_src,
                                 num_dst, opts, name, transpose);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> coo_to_csr(
    const at::Tensor& src, const at::Tensor& dst, int64_t num_src, int64_t num_dst, bool small) {
  auto o = coo_convert(src, dst, num_src, num_dst, small, false, "granii::coo_to_csr");
  return {std::get<0>(o), std::get<1>(o), std::get<2>(o), std::get<3>(o), std::get<4>(o),
          std::get<5>(o)};
}

CooOut coo_to_csr_both(const at::Tensor& src, const at::Tensor& dst, int64_t num_src,
                       int64_t num_dst, bool small) {
  return coo_convert(src, dst, num_src, num_dst, small, true, "granii::coo_to_csr_both");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_segments(const at::Tensor& counts,
                                                              int64_t num_nodes) {
  const char* name = "granii::batch_segments";
  TORCH_CHECK(counts.dim() == 1, name, ": counts must be 1-D, one per graph");
  TORCH_CHECK(num_nodes >= 0 && num_nodes < (int64_t{1} << 31), name,
              ": num_nodes must be in [0, 2^31)");
  const at::Tensor c = counts.to(at::kLong).contiguous();
  const int64_t g = c.numel();
  const int64_t* cp = c.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < g; ++b) {
    TORCH_CHECK(cp[b] >= 0, name, ": the node count of graph ", b, " is negative (", cp[b], ")");
    total += cp[b];
  }
  TORCH_CHECK(total == num_nodes, name, ": the batch's node counts add up to ", total,
              ", the graph has ", num_nodes, " nodes");
  const auto opts = c.options();
  at::Tensor off = at::empty({g + 1}, opts), off32 = at::empty({g + 1}, opts.dtype(at::kInt));
  at::Tensor of = at::empty({num_nodes}, opts);
  int64_t* o = off.data_ptr<int64_t>();
  int32_t* o32 = off32.data_ptr<int32_t>();
  int64_t* gp = of.data_ptr<int64_t>();
  o[0] = 0;
  o32[0] = 0;
  for (int64_t b = 0; b < g; ++b) {
    o[b + 1] = o[b] + cp[b];
    o32[b + 1] = static_cast<int32_t>(o[b + 1]);
    std::fill(gp + o[b], gp + o[b + 1], b);
  }
  return {off, off32, of};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("csr_transpose(Tensor indptr, Tensor indices, Tensor? eids, int n_cols) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("csr_narrow(Tensor indptr, Tensor indices, Tensor eids, int n_cols, bool small) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("coo_to_csr(Tensor src, Tensor dst, int num_src, int num_dst, bool small) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("coo_to_csr_both(Tensor src, Tensor dst, int num_src, int num_dst, bool small) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("batch_segments(Tensor counts, int num_nodes) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("csr_transpose", &csr_transpose);
  m.impl("csr_narrow", &csr_narrow);
  m.impl("coo_to_csr", &coo_to_csr);
  m.impl("coo_to_csr_both", &coo_to_csr_both);
  m.impl("batch_segments", &batch_segments);
}

}  // namespace granii
