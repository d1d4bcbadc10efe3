// Edge messages of node rows and edge features (granii/kernels/edge_message.py).
//
// For each edge e = u -> v the pre-activation is p_e = a[u] + b[v] + c[e] (any of a, b, c may be
// absent), m_e = act(p_e) with act none (0), relu (1) or leaky relu (2, slope s). Two kernels:
//
//   edge_message_sum     y[v]    = sum_{e -> v} m_e                       (N x K)
//   edge_message_score   s[e, h] = sum_f att[h, f] m_e[h F + f]           (E x H, K = H F)
//
// Both walk the CSR of A (rows = destinations) in parallel over rows; m_e is never stored. The
// backwards recompute p_e: dp_e = dm_e * act'(p_e), with dm_e = dy[v] (sum) or ds[e, h] att[h, f]
// (score). The gradients of b (summed per destination) and of c (one row per edge: its size)
// come from the walk over A; that of a (summed per source) from a walk over A^T, so no two
// threads write one row. The score's d att sums ds[e, h] m_e over all edges: a partial sum per
// part of the rows, added at the end.
#include "native.h"

#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include <vector>

namespace granii {
namespace {

using OptT = c10::optional<at::Tensor>;

template <typename T>
inline T act_fwd(T p, int64_t act, T slope) {
  if (act == 1) return p > T(0) ? p : T(0);
  if (act == 2) return p > T(0) ? p : p * slope;
  return p;
}

template <typename T>
inline T act_grad(T p, int64_t act, T slope) {
  if (act == 1) return p > T(0) ? T(1) : T(0);
  if (act == 2) return p > T(0) ? T(1) : slope;
  return T(1);
}

// The operands of one call: raw pointers (nullptr where absent) and the width K.
template <typename T, typename I>
struct Operands {
  const T* a;
  const T* b;
  const T* c;
  const I* eids;     // edge id of each CSR entry of A; nullptr: entry j is edge j
  int64_t K;

  inline int64_t edge(int64_t j) const { return eids ? static_cast<int64_t>(eids[j]) : j; }

  // p[k] = a[u, k] + b[v, k] + c[e, k]
  inline void pre(int64_t u, int64_t v, int64_t e, T* p) const {
    for (int64_t k = 0; k < K; ++k) p[k] = T(0);
    if (a) for (int64_t k = 0; k < K; ++k) p[k] += a[u * K + k];
    if (b) for (int64_t k = 0; k < K; ++k) p[k] += b[v * K + k];
    if (c) for (int64_t k = 0; k < K; ++k) p[k] += c[e * K + k];
  }
};

template <typename T>
const T* ptr_or_null(const OptT& t) {
  return t.has_value() && t->defined() ? t->data_ptr<T>() : nullptr;
}

template <typename I>
const I* eids_or_null(const OptT& t) {
  return t.has_value() && t->defined() ? t->data_ptr<I>() : nullptr;
}

void check_operands(const OptT& a, const OptT& b, const OptT& c, int64_t K, const char* name) {
  int64_t given = 0;
  at::ScalarType dtype = at::kFloat;
  for (const OptT* t : {&a, &b, &c}) {
    if (!t->has_value() || !(*t)->defined()) continue;
    TORCH_CHECK((*t)->dim() == 2 && (*t)->size(1) == K, name, ": operands must be (n, K)");
    if (given == 0) dtype = (*t)->scalar_type();
    check_dense(**t, "an operand", name, dtype);
    ++given;
  }
  TORCH_CHECK(given > 0, name, ": at least one operand is needed");
}

at::ScalarType dtype_of(const OptT& a, const OptT& b, const OptT& c) {
  for (const OptT* t : {&a, &b, &c})
    if (t->has_value() && (*t)->defined()) return (*t)->scalar_type();
  return at::kFloat;
}

// Grain of a parallel loop over `rows` rows: all of them on one thread when the work is small.
int64_t grain(int64_t rows, int64_t nnz, int64_t K) {
  return num_parts(0, rows, nnz, K) == 1 ? std::max<int64_t>(rows, 1) : 1;
}

// The gradient of a (summed per source): the walk over A^T (rows are sources, indices
// destinations), so each thread writes its own rows of da. For each edge e = u -> v,
// add(du, p, v, e) adds the edge's term to da[u], p holding its pre-activation p_e.
template <typename T, typename I, typename Add>
void source_grad(const Operands<T, I>& op, const at::Tensor& t_indptr, const at::Tensor& t_indices,
                 int64_t nnz, T* pda, Add add) {
  const int64_t t_rows = t_indptr.numel() - 1, K = op.K;
  const I* ip = t_indptr.data_ptr<I>();
  const I* ix = t_indices.data_ptr<I>();
  at::parallel_for(0, t_rows, grain(t_rows, nnz, K), [&](int64_t r0, int64_t r1) {
    std::vector<T> p(K);
    for (int64_t u = r0; u < r1; ++u) {
      for (int64_t j = ip[u]; j < ip[u + 1]; ++j) {
        const int64_t v = ix[j], e = op.edge(j);
        op.pre(u, v, e, p.data());
        add(pda + u * K, p.data(), v, e);
      }
    }
  });
}

// ---- edge_message_sum ---------------------------------------------------------------------------
at::Tensor edge_message_sum(const at::Tensor& indptr, const at::Tensor& indices, const OptT& eids,
                            const OptT& a, const OptT& b, const OptT& c, int64_t act, double slope,
                            int64_t K) {
  check_csr(indptr, indices, "edge_message_sum");
  check_operands(a, b, c, K, "edge_message_sum");
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  auto out = at::zeros({rows, K}, at::TensorOptions().dtype(dtype_of(a, b, c)));
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "edge_message_sum", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "edge_message_sum", [&] {
      const index_t* ip = indptr.data_ptr<index_t>();
      const index_t* ix = indices.data_ptr<index_t>();
      const Operands<T, index_t> op{ptr_or_null<T>(a), ptr_or_null<T>(b), ptr_or_null<T>(c),
                                    eids_or_null<index_t>(eids), K};
      T* y = out.data_ptr<T>();
      const T s = static_cast<T>(slope);
      at::parallel_for(0, rows, grain(rows, nnz, K), [&](int64_t r0, int64_t r1) {
        std::vector<T> p(K);
        for (int64_t v = r0; v < r1; ++v) {
          T* yv = y + v * K;
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            op.pre(ix[j], v, op.edge(j), p.data());
            for (int64_t k = 0; k < K; ++k) yv[k] += act_fwd(p[k], act, s);
          }
        }
      });
    });
  });
  return out;
}

// Gradients of edge_message_sum: (da, db, dc), each undefined where not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> edge_message_sum_backward(
    const at::Tensor& indptr, const at::Tensor& indices, const OptT& eids,
    const at::Tensor& t_indptr, const at::Tensor& t_indices, const OptT& t_eids,
    const OptT& a, const OptT& b, const OptT& c, int64_t act, double slope,
    const at::Tensor& dy, bool need_a, bool need_b, bool need_c) {
  check_csr(indptr, indices, "edge_message_sum_backward");
  check_csr(t_indptr, t_indices, "edge_message_sum_backward");
  const int64_t K = dy.size(1), rows = indptr.numel() - 1, nnz = indices.numel();
  check_operands(a, b, c, K, "edge_message_sum_backward");
  check_dense(dy, "dy", "edge_message_sum_backward", dtype_of(a, b, c));
  const auto opts = dy.options();
  at::Tensor da, db, dc;
  if (need_a) da = at::zeros({t_indptr.numel() - 1, K}, opts);
  if (need_b) db = at::zeros({rows, K}, opts);
  if (need_c) dc = at::zeros({nnz, K}, opts);
  AT_DISPATCH_FLOATING_TYPES(dy.scalar_type(), "edge_message_sum_backward", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "edge_message_sum_backward", [&] {
      const T s = static_cast<T>(slope);
      const T* g = dy.data_ptr<T>();
      const T* pa = ptr_or_null<T>(a);
      const T* pb = ptr_or_null<T>(b);
      const T* pc = ptr_or_null<T>(c);
      if (need_b || need_c) {          // over A: rows are destinations
        const index_t* ip = indptr.data_ptr<index_t>();
        const index_t* ix = indices.data_ptr<index_t>();
        const Operands<T, index_t> op{pa, pb, pc, eids_or_null<index_t>(eids), K};
        T* pdb = need_b ? db.data_ptr<T>() : nullptr;
        T* pdc = need_c ? dc.data_ptr<T>() : nullptr;
        at::parallel_for(0, rows, grain(rows, nnz, K), [&](int64_t r0, int64_t r1) {
          std::vector<T> p(K);
          for (int64_t v = r0; v < r1; ++v) {
            const T* gv = g + v * K;
            for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
              const int64_t e = op.edge(j);
              op.pre(ix[j], v, e, p.data());
              for (int64_t k = 0; k < K; ++k) {
                const T d = gv[k] * act_grad(p[k], act, s);
                if (pdb) pdb[v * K + k] += d;
                if (pdc) pdc[e * K + k] = d;
              }
            }
          }
        });
      }
      if (need_a) {
        const Operands<T, index_t> op{pa, pb, pc, eids_or_null<index_t>(t_eids), K};
        source_grad(op, t_indptr, t_indices, nnz, da.data_ptr<T>(),
                    [&](T* du, const T* p, int64_t v, int64_t) {
                      for (int64_t k = 0; k < K; ++k) du[k] += g[v * K + k] * act_grad(p[k], act, s);
                    });
      }
    });
  });
  return {da, db, dc};
}

// ---- edge_message_score -------------------------------------------------------------------------
at::Tensor edge_message_score(const at::Tensor& indptr, const at::Tensor& indices, const OptT& eids,
                              const OptT& a, const OptT& b, const OptT& c, int64_t act,
                              double slope, const at::Tensor& att) {
  check_csr(indptr, indices, "edge_message_score");
  TORCH_CHECK(att.dim() == 2, "edge_message_score: att must be (H, F)");
  const int64_t H = att.size(0), F = att.size(1), K = H * F;
  check_operands(a, b, c, K, "edge_message_score");
  check_dense(att, "att", "edge_message_score", dtype_of(a, b, c));
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  auto out = at::empty({nnz, H}, att.options());
  AT_DISPATCH_FLOATING_TYPES(att.scalar_type(), "edge_message_score", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "edge_message_score", [&] {
      const index_t* ip = indptr.data_ptr<index_t>();
      const index_t* ix = indices.data_ptr<index_t>();
      const Operands<T, index_t> op{ptr_or_null<T>(a), ptr_or_null<T>(b), ptr_or_null<T>(c),
                                    eids_or_null<index_t>(eids), K};
      const T* w = att.data_ptr<T>();
      T* y = out.data_ptr<T>();
      const T s = static_cast<T>(slope);
      at::parallel_for(0, rows, grain(rows, nnz, K), [&](int64_t r0, int64_t r1) {
        std::vector<T> p(K);
        for (int64_t v = r0; v < r1; ++v) {
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            const int64_t e = op.edge(j);
            op.pre(ix[j], v, e, p.data());
            for (int64_t h = 0; h < H; ++h) {
              T acc = 0;
              for (int64_t f = 0; f < F; ++f) acc += w[h * F + f] * act_fwd(p[h * F + f], act, s);
              y[e * H + h] = acc;
            }
          }
        }
      });
    });
  });
  return out;
}

// Gradients of edge_message_score: (da, db, dc, datt), each undefined where not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> edge_message_score_backward(
    const at::Tensor& indptr, const at::Tensor& indices, const OptT& eids,
    const at::Tensor& t_indptr, const at::Tensor& t_indices, const OptT& t_eids,
    const OptT& a, const OptT& b, const OptT& c, int64_t act, double slope,
    const at::Tensor& att, const at::Tensor& ds, bool need_a, bool need_b, bool need_c,
    bool need_att) {
  check_csr(indptr, indices, "edge_message_score_backward");
  check_csr(t_indptr, t_indices, "edge_message_score_backward");
  const int64_t H = att.size(0), F = att.size(1), K = H * F;
  const int64_t rows = indptr.numel() - 1, nnz = indices.numel();
  check_operands(a, b, c, K, "edge_message_score_backward");
  check_dense(ds, "ds", "edge_message_score_backward", att.scalar_type());
  const auto opts = att.options();
  at::Tensor da, db, dc, datt;
  if (need_a) da = at::zeros({t_indptr.numel() - 1, K}, opts);
  if (need_b) db = at::zeros({rows, K}, opts);
  if (need_c) dc = at::zeros({nnz, K}, opts);
  if (need_att) datt = at::zeros({H, F}, opts);
  AT_DISPATCH_FLOATING_TYPES(att.scalar_type(), "edge_message_score_backward", [&] {
    using T = scalar_t;
    GRANII_DISPATCH_INDEX(indptr.scalar_type(), "edge_message_score_backward", [&] {
      const T s = static_cast<T>(slope);
      const T* w = att.data_ptr<T>();
      const T* g = ds.data_ptr<T>();
      const T* pa = ptr_or_null<T>(a);
      const T* pb = ptr_or_null<T>(b);
      const T* pc = ptr_or_null<T>(c);
      if (need_b || need_c || need_att) {     // over A, in parts: d att summed per part
        const index_t* ip = indptr.data_ptr<index_t>();
        const index_t* ix = indices.data_ptr<index_t>();
        const Operands<T, index_t> op{pa, pb, pc, eids_or_null<index_t>(eids), K};
        T* pdb = need_b ? db.data_ptr<T>() : nullptr;
        T* pdc = need_c ? dc.data_ptr<T>() : nullptr;
        const int64_t parts = std::min<int64_t>(num_parts(0, rows, nnz, K), std::max<int64_t>(rows, 1));
        std::vector<T> partial(need_att ? parts * K : 0, T(0));
        at::parallel_for(0, parts, 1, [&](int64_t q0, int64_t q1) {
          std::vector<T> p(K);
          for (int64_t q = q0; q < q1; ++q) {
            T* dw = need_att ? partial.data() + q * K : nullptr;
            for (int64_t v = rows * q / parts; v < rows * (q + 1) / parts; ++v) {
              for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
                const int64_t e = op.edge(j);
                op.pre(ix[j], v, e, p.data());
                for (int64_t h = 0; h < H; ++h) {
                  const T ge = g[e * H + h];
                  for (int64_t f = 0; f < F; ++f) {
                    const int64_t k = h * F + f;
                    if (dw) dw[k] += ge * act_fwd(p[k], act, s);
                    const T d = ge * w[k] * act_grad(p[k], act, s);
                    if (pdb) pdb[v * K + k] += d;
                    if (pdc) pdc[e * K + k] = d;
                  }
                }
              }
            }
          }
        });
        if (need_att) {
          T* out = datt.data_ptr<T>();
          for (int64_t q = 0; q < parts; ++q)
            for (int64_t k = 0; k < K; ++k) out[k] += partial[q * K + k];
        }
      }
      if (need_a) {
        const Operands<T, index_t> op{pa, pb, pc, eids_or_null<index_t>(t_eids), K};
        source_grad(op, t_indptr, t_indices, nnz, da.data_ptr<T>(),
                    [&](T* du, const T* p, int64_t, int64_t e) {
                      for (int64_t h = 0; h < H; ++h) {
                        const T ge = g[e * H + h];
                        for (int64_t f = 0; f < F; ++f) {
                          const int64_t k = h * F + f;
                          du[k] += ge * w[k] * act_grad(p[k], act, s);
                        }
                      }
                    });
      }
    });
  });
  return {da, db, dc, datt};
}

}  // namespace
}  // namespace granii

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("edge_message_sum(Tensor indptr, Tensor indices, Tensor? eids, Tensor? a, Tensor? b, "
        "Tensor? c, int act, float slope, int K) -> Tensor");
  m.def("edge_message_sum_backward(Tensor indptr, Tensor indices, Tensor? eids, Tensor t_indptr, "
        "Tensor t_indices, Tensor? t_eids, Tensor? a, Tensor? b, Tensor? c, int act, float slope, "
        "Tensor dy, bool need_a, bool need_b, bool need_c) -> (Tensor, Tensor, Tensor)");
  m.def("edge_message_score(Tensor indptr, Tensor indices, Tensor? eids, Tensor? a, Tensor? b, "
        "Tensor? c, int act, float slope, Tensor att) -> Tensor");
  m.def("edge_message_score_backward(Tensor indptr, Tensor indices, Tensor? eids, "
        "Tensor t_indptr, Tensor t_indices, Tensor? t_eids, Tensor? a, Tensor? b, Tensor? c, "
        "int act, float slope, Tensor att, Tensor ds, bool need_a, bool need_b, bool need_c, "
        "bool need_att) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("edge_message_sum", &granii::edge_message_sum);
  m.impl("edge_message_sum_backward", &granii::edge_message_sum_backward);
  m.impl("edge_message_score", &granii::edge_message_score);
  m.impl("edge_message_score_backward", &granii::edge_message_score_backward);
}
