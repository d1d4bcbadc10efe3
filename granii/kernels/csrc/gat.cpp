// GAT attention fused with its aggregation, and the edge-wise kernels it is made of (SDDMM add,
// edge softmax), on the CSR of A (one row per destination, columns = sources, plus the edge id of
// each entry so that edge tensors stay in the graph's edge-id order).
//
// Fused forward, per destination v and head h, over the in-edges e = (u -> v):
//   x_e = el[u,h] + er[v,h],  z_e = leaky_relu(x_e),  m_v = max_e z_e,  S_v = sum_e exp(z_e - m_v)
//   out[v,h,:] = sum_e (exp(z_e - m_v) / S_v) * w_e * feat[u,h,:]
// Scores live only in a per-row scratch buffer; m_v and 1/S_v are kept for the backward, which
// recomputes a_e = exp(z_e - m_v) / S_v instead of storing an edge x head matrix.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "native.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace granii {
namespace {

// Below this many multiply-adds a call runs on one thread: a parallel region costs more.
constexpr int64_t kSerialWork = 1 << 15;

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

template <typename T>
inline T leaky(T x, T slope) { return x > T(0) ? x : x * slope; }

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

// fn(row_begin, row_end) over all rows, one balanced range per thread of torch's pool.
template <typename I, typename Fn>
void parallel_rows(const I* indptr, int64_t rows, int64_t work, const Fn& fn) {
  const int parts = at::get_num_threads();
  if (parts <= 1 || rows < 2 || work < kSerialWork || at::in_parallel_region()) {
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
  const I* eids;     // (nnz,) edge id of each entry
  const T* el;       // (num_src, H)
  const T* er;       // (num_dst, H)
  const T* feat;     // (num_src, H, F)
  const T* w;        // (E,) or nullptr
  T slope;
  int64_t H, F;
};

// ---------------------------------------------------------------------------------------------
// Forward over destination rows [r0, r1): out (rows, H, F), row max m and 1 / S (rows, H).
template <int FC, typename T, typename I>
void forward_rows(const Gat<T, I>& g, T* out, T* mx, T* inv, int64_t r0, int64_t r1) {
  const int64_t H = g.H, F = FC > 0 ? FC : g.F, HF = H * F;
  std::vector<T> sc, m(H), s(H);
  for (int64_t v = r0; v < r1; ++v) {
    const int64_t b = g.indptr[v], deg = g.indptr[v + 1] - b;
    T* o = out + v * HF;
    std::fill(o, o + HF, T(0));
    if (deg == 0) {
      std::fill(mx + v * H, mx + v * H + H, T(0));
      std::fill(inv + v * H, inv + v * H + H, T(0));
      continue;
    }
    if (static_cast<int64_t>(sc.size()) < deg * H) sc.resize(deg * H);
    T* S = sc.data();
    const T* erv = g.er + v * H;
    std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
    for (int64_t j = 0; j < deg; ++j) {
      const T* elu = g.el + static_cast<int64_t>(g.indices[b + j]) * H;
      T* sj = S + j * H;
      for (int64_t h = 0; h < H; ++h) {
        const T z = leaky(elu[h] + erv[h], g.slope);
        sj[h] = z;
        m[h] = std::max(m[h], z);
      }
    }
    std::fill(s.begin(), s.end(), T(0));
    for (int64_t j = 0; j < deg; ++j) {
      T* sj = S + j * H;
      for (int64_t h = 0; h < H; ++h) {
        const T p = exp_approx(sj[h] - m[h]);
        sj[h] = p;
        s[h] += p;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      s[h] = T(1) / s[h];
      mx[v * H + h] = m[h];
      inv[v * H + h] = s[h];
    }
    for (int64_t j = 0; j < deg; ++j) {
      const T* x = g.feat + static_cast<int64_t>(g.indices[b + j]) * HF;
      const T wj = g.w ? g.w[g.eids[b + j]] : T(1);
      const T* sj = S + j * H;
      for (int64_t h = 0; h < H; ++h) {
        const T c = sj[h] * s[h] * wj;
        T* oh = o + h * F;
        const T* xh = x + h * F;
        for (int64_t f = 0; f < F; ++f) oh[f] += c * xh[f];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, part 1, over source rows [r0, r1) of A^T (g.indptr/indices/eids are the transpose:
// rows = sources, columns = destinations). With a_e recomputed from m_v and 1/S_v,
//   d_e   = <dout[v,h], feat[u,h]>,   D_v = <dout[v,h], out[v,h]> = sum_e a_e w_e d_e
//   dfeat[u,h] = sum_e a_e w_e dout[v,h]
//   dx_e  = a_e (w_e d_e - D_v) * leaky'(x_e),  del[u,h] = sum_e dx_e
//   dw_e  = sum_h a_e d_e
// dx_e is written to gx (E, H) for the destination-side sum der[v,h] = sum_e dx_e.
template <typename T>
struct Grads {
  const T* dout;  // (num_dst, H, F)
  const T* dsum;  // (num_dst, H): D_v
  const T* mx;
  const T* inv;
  T* dfeat;       // (num_src, H, F) or nullptr
  T* del;         // (num_src, H) or nullptr
  T* gx;          // (E, H) or nullptr
  T* dw;          // (E,) or nullptr
};

template <int FC, typename T, typename I>
void backward_src_rows(const Gat<T, I>& g, const Grads<T>& d, int64_t r0, int64_t r1) {
  const int64_t H = g.H, F = FC > 0 ? FC : g.F, HF = H * F;
  const bool need_x = d.del || d.gx || d.dw;
  std::vector<T> a(H), dl(H);
  for (int64_t u = r0; u < r1; ++u) {
    const int64_t b = g.indptr[u], end = g.indptr[u + 1];
    const T* fu = g.feat + u * HF;
    const T* elu = g.el + u * H;
    T* dfu = d.dfeat ? d.dfeat + u * HF : nullptr;
    if (dfu) std::fill(dfu, dfu + HF, T(0));
    std::fill(dl.begin(), dl.end(), T(0));
    for (int64_t j = b; j < end; ++j) {
      const int64_t v = g.indices[j], e = g.eids[j];
      const T wj = g.w ? g.w[e] : T(1);
      const T* erv = g.er + v * H;
      const T* mv = d.mx + v * H;
      const T* iv = d.inv + v * H;
      for (int64_t h = 0; h < H; ++h) a[h] = exp_approx(leaky(elu[h] + erv[h], g.slope) - mv[h]) * iv[h];
      const T* dov = d.dout + v * HF;
      T dwe = T(0);
      for (int64_t h = 0; h < H; ++h) {
        const T* doh = dov + h * F;
        if (dfu) {
          const T c = a[h] * wj;
          T* dfh = dfu + h * F;
          for (int64_t f = 0; f < F; ++f) dfh[f] += c * doh[f];
        }
        if (need_x) {
          const T* fh = fu + h * F;
          T dot = T(0);
          for (int64_t f = 0; f < F; ++f) dot += doh[f] * fh[f];
          dwe += a[h] * dot;
          const T x = elu[h] + erv[h];
          T dx = a[h] * (wj * dot - d.dsum[v * H + h]);
          dx = x > T(0) ? dx : dx * g.slope;
          dl[h] += dx;
          if (d.gx) d.gx[e * H + h] = dx;
        }
      }
      if (d.dw) d.dw[e] = dwe;
    }
    if (d.del) std::copy(dl.begin(), dl.end(), d.del + u * H);
  }
}

// Row sums of gathered edge values: y[v, k] = sum_{j in row v} x[eids[j], k]; x (E, K).
template <typename T, typename I>
void gather_row_sum(const I* indptr, const I* eids, const T* x, int64_t rows, int64_t K, T* y) {
  parallel_rows(indptr, rows, (indptr[rows] - indptr[0]) * K, [&](int64_t r0, int64_t r1) {
    for (int64_t v = r0; v < r1; ++v) {
      T* yv = y + v * K;
      std::fill(yv, yv + K, T(0));
      for (int64_t j = indptr[v]; j < indptr[v + 1]; ++j) {
        const T* xe = x + static_cast<int64_t>(eids[j]) * K;
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
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 16: fn(std::integral_constant<int, 16>()); break;
    case 32: fn(std::integral_constant<int, 32>()); break;
    case 64: fn(std::integral_constant<int, 64>()); break;
    case 128: fn(std::integral_constant<int, 128>()); break;
    case 256: fn(std::integral_constant<int, 256>()); break;
    default: fn(std::integral_constant<int, 0>()); break;
  }
}

template <typename Fn>
void dispatch_index(const at::Tensor& t, const Fn& fn) {
  if (t.scalar_type() == at::kInt) fn(int32_t(0));
  else if (t.scalar_type() == at::kLong) fn(int64_t(0));
  else TORCH_CHECK(false, "granii: CSR indices must be int32 or int64");
}

void check_csr3(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& eids) {
  TORCH_CHECK(indptr.dim() == 1 && indices.dim() == 1 && eids.dim() == 1, "granii: CSR arrays must be 1-D");
  TORCH_CHECK(indptr.is_contiguous() && indices.is_contiguous() && eids.is_contiguous(),
              "granii: CSR arrays must be contiguous");
  TORCH_CHECK(indptr.scalar_type() == indices.scalar_type() && indptr.scalar_type() == eids.scalar_type(),
              "granii: CSR arrays must share one index type");
}

template <typename T, typename I>
Gat<T, I> make_gat(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& eids,
                   const at::Tensor& el, const at::Tensor& er, const at::Tensor& feat,
                   const c10::optional<at::Tensor>& w, double slope) {
  Gat<T, I> g;
  g.indptr = indptr.data_ptr<I>();
  g.indices = indices.data_ptr<I>();
  g.eids = eids.data_ptr<I>();
  g.el = el.data_ptr<T>();
  g.er = er.data_ptr<T>();
  g.feat = feat.data_ptr<T>();
  g.w = w.has_value() ? w->data_ptr<T>() : nullptr;
  g.slope = static_cast<T>(slope);
  g.H = feat.size(1);
  g.F = feat.size(2);
  return g;
}

// (out, m, 1/S): out (num_dst, H, F); indptr over num_dst rows.
std::vector<at::Tensor> gat_forward(at::Tensor indptr, at::Tensor indices, at::Tensor eids,
                                       at::Tensor el, at::Tensor er, at::Tensor feat,
                                       c10::optional<at::Tensor> w, double slope) {
  check_csr3(indptr, indices, eids);
  TORCH_CHECK(feat.dim() == 3 && el.dim() == 2 && er.dim() == 2, "granii: feat (n, H, F), el/er (n, H)");
  TORCH_CHECK(el.is_contiguous() && er.is_contiguous() && feat.is_contiguous(), "granii: inputs must be contiguous");
  TORCH_CHECK(el.scalar_type() == feat.scalar_type() && er.scalar_type() == feat.scalar_type(),
              "granii: el, er, feat must share a dtype");
  const int64_t rows = indptr.size(0) - 1, H = feat.size(1), F = feat.size(2);
  auto out = at::empty({rows, H, F}, feat.options());
  auto mx = at::empty({rows, H}, feat.options());
  auto inv = at::empty({rows, H}, feat.options());
  AT_DISPATCH_FLOATING_TYPES(feat.scalar_type(), "gat_forward", [&] {
    dispatch_index(indptr, [&](auto ityp) {
      using I = decltype(ityp);
      const auto g = make_gat<scalar_t, I>(indptr, indices, eids, el, er, feat, w, slope);
      const int64_t work = indices.size(0) * H * F;
      dispatch_width(F, [&](auto fc) {
        parallel_rows(g.indptr, rows, work, [&](int64_t r0, int64_t r1) {
          forward_rows<decltype(fc)::value>(g, out.data_ptr<scalar_t>(), mx.data_ptr<scalar_t>(),
                                            inv.data_ptr<scalar_t>(), r0, r1);
        });
      });
    });
  });
  return {out, mx, inv};
}

// Gradients (del, der, dfeat, dw) of gat_forward; undefined tensors where need_* is false.
// t_* is the CSR of A^T (rows = sources); in_* the CSR of A.
std::vector<at::Tensor> gat_backward(at::Tensor in_indptr, at::Tensor in_eids,
                                        at::Tensor t_indptr, at::Tensor t_indices, at::Tensor t_eids,
                                        at::Tensor el, at::Tensor er, at::Tensor feat,
                                        c10::optional<at::Tensor> w, double slope,
                                        at::Tensor mx, at::Tensor inv, at::Tensor out,
                                        at::Tensor dout, bool need_el, bool need_er, bool need_feat,
                                        bool need_w) {
  check_csr3(t_indptr, t_indices, t_eids);
  dout = dout.contiguous();
  const int64_t n_src = t_indptr.size(0) - 1, n_dst = in_indptr.size(0) - 1;
  const int64_t H = feat.size(1), F = feat.size(2), E = t_indices.size(0);
  // D_v = <dout[v,h], out[v,h]>, the softmax's row term
  auto dsum = (dout * out).sum(-1).contiguous();
  at::Tensor del, der, dfeat, dw, gx;
  if (need_el) del = at::empty({n_src, H}, feat.options());
  if (need_er) gx = at::empty({E, H}, feat.options());
  if (need_feat) dfeat = at::empty({n_src, H, F}, feat.options());
  if (need_w && w.has_value()) dw = at::empty({E}, feat.options());
  AT_DISPATCH_FLOATING_TYPES(feat.scalar_type(), "gat_backward", [&] {
    using T = scalar_t;
    dispatch_index(t_indptr, [&](auto ityp) {
      using I = decltype(ityp);
      const auto g = make_gat<T, I>(t_indptr, t_indices, t_eids, el, er, feat, w, slope);
      Grads<T> d{dout.data_ptr<T>(), dsum.data_ptr<T>(), mx.data_ptr<T>(), inv.data_ptr<T>(),
                 need_feat ? dfeat.data_ptr<T>() : nullptr, need_el ? del.data_ptr<T>() : nullptr,
                 need_er ? gx.data_ptr<T>() : nullptr, dw.defined() ? dw.data_ptr<T>() : nullptr};
      const int64_t work = 2 * E * H * F;
      dispatch_width(F, [&](auto fc) {
        parallel_rows(g.indptr, n_src, work, [&](int64_t r0, int64_t r1) {
          backward_src_rows<decltype(fc)::value>(g, d, r0, r1);
        });
      });
      if (need_er) {
        der = at::empty({n_dst, H}, feat.options());
        gather_row_sum<T, I>(in_indptr.data_ptr<I>(), in_eids.data_ptr<I>(), gx.data_ptr<T>(), n_dst, H,
                             der.data_ptr<T>());
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
    dispatch_index(src, [&](auto ityp) {
      using I = decltype(ityp);
      const I* s = src.data_ptr<I>();
      const I* d = dst.data_ptr<I>();
      const T* pa = a.data_ptr<T>();
      const T* pb = b.data_ptr<T>();
      T* po = out.data_ptr<T>();
      const int64_t grain = std::max<int64_t>(1, kSerialWork / std::max<int64_t>(K, 1));
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
at::Tensor edge_row_sum(at::Tensor indptr, at::Tensor eids, at::Tensor x) {
  x = x.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = x.size(1);
  auto y = at::empty({rows, K}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "edge_row_sum", [&] {
    dispatch_index(indptr, [&](auto ityp) {
      using I = decltype(ityp);
      gather_row_sum<scalar_t, I>(indptr.data_ptr<I>(), eids.data_ptr<I>(), x.data_ptr<scalar_t>(), rows, K,
                                  y.data_ptr<scalar_t>());
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// Edge softmax over the in-edges of each row: a[e,k] = exp(x[e,k] - m_v) / sum exp(x[e',k] - m_v).
at::Tensor edge_softmax_forward(at::Tensor indptr, at::Tensor eids, at::Tensor x) {
  x = x.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = x.size(1);
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "edge_softmax_forward", [&] {
    using T = scalar_t;
    dispatch_index(indptr, [&](auto ityp) {
      using I = decltype(ityp);
      const I* ip = indptr.data_ptr<I>();
      const I* ei = eids.data_ptr<I>();
      const T* px = x.data_ptr<T>();
      T* py = y.data_ptr<T>();
      parallel_rows(ip, rows, (ip[rows] - ip[0]) * K * 4, [&](int64_t r0, int64_t r1) {
        std::vector<T> m(K), s(K);
        for (int64_t v = r0; v < r1; ++v) {
          const int64_t b = ip[v], e = ip[v + 1];
          if (b == e) continue;
          std::fill(m.begin(), m.end(), -std::numeric_limits<T>::infinity());
          for (int64_t j = b; j < e; ++j) {
            const T* xe = px + static_cast<int64_t>(ei[j]) * K;
            for (int64_t k = 0; k < K; ++k) m[k] = std::max(m[k], xe[k]);
          }
          std::fill(s.begin(), s.end(), T(0));
          for (int64_t j = b; j < e; ++j) {
            const int64_t off = static_cast<int64_t>(ei[j]) * K;
            for (int64_t k = 0; k < K; ++k) {
              const T p = exp_approx(px[off + k] - m[k]);
              py[off + k] = p;
              s[k] += p;
            }
          }
          for (int64_t k = 0; k < K; ++k) s[k] = T(1) / s[k];
          for (int64_t j = b; j < e; ++j) {
            T* ye = py + static_cast<int64_t>(ei[j]) * K;
            for (int64_t k = 0; k < K; ++k) ye[k] *= s[k];
          }
        }
      });
    });
  });
  return y;
}

// dx[e] = a[e] (g[e] - sum_{e' in row} a[e'] g[e']).
at::Tensor edge_softmax_backward(at::Tensor indptr, at::Tensor eids, at::Tensor a, at::Tensor g) {
  a = a.contiguous();
  g = g.contiguous();
  const int64_t rows = indptr.size(0) - 1, K = a.size(1);
  auto dx = at::empty_like(a);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "edge_softmax_backward", [&] {
    using T = scalar_t;
    dispatch_index(indptr, [&](auto ityp) {
      using I = decltype(ityp);
      const I* ip = indptr.data_ptr<I>();
      const I* ei = eids.data_ptr<I>();
      const T* pa = a.data_ptr<T>();
      const T* pg = g.data_ptr<T>();
      T* pd = dx.data_ptr<T>();
      parallel_rows(ip, rows, (ip[rows] - ip[0]) * K * 2, [&](int64_t r0, int64_t r1) {
        std::vector<T> s(K);
        for (int64_t v = r0; v < r1; ++v) {
          std::fill(s.begin(), s.end(), T(0));
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            const int64_t off = static_cast<int64_t>(ei[j]) * K;
            for (int64_t k = 0; k < K; ++k) s[k] += pa[off + k] * pg[off + k];
          }
          for (int64_t j = ip[v]; j < ip[v + 1]; ++j) {
            const int64_t off = static_cast<int64_t>(ei[j]) * K;
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
      "gat_forward(Tensor indptr, Tensor indices, Tensor eids, Tensor el, Tensor er, Tensor feat, "
      "Tensor? w, float slope) -> Tensor[]");
  m.def(
      "gat_backward(Tensor in_indptr, Tensor in_eids, Tensor t_indptr, Tensor t_indices, "
      "Tensor t_eids, Tensor el, Tensor er, Tensor feat, Tensor? w, float slope, Tensor mx, "
      "Tensor inv, Tensor out, Tensor dout, bool need_el, bool need_er, bool need_feat, "
      "bool need_w) -> Tensor[]");
  m.def("sddmm_add_coo(Tensor src, Tensor dst, Tensor a, Tensor b) -> Tensor");
  m.def("edge_row_sum(Tensor indptr, Tensor eids, Tensor x) -> Tensor");
  m.def("edge_softmax_csr(Tensor indptr, Tensor eids, Tensor x) -> Tensor");
  m.def("edge_softmax_csr_backward(Tensor indptr, Tensor eids, Tensor a, Tensor g) -> Tensor");
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
