// GAT's attention terms: one dot product per row and head (primitive head_dot, impl "native").
//
//   granii::head_dot(x, a) -> y
//       x (n, H * F), a (H, F): y[i, h] = sum_f x[i, h F + f] a[h, f]. Returns (n, H).
//   granii::head_dot_backward(g, x, a, need_x, need_a) -> (dx, da)
//       dx[i, h F + f] = g[i, h] a[h, f]              (n, H F); undefined unless need_x
//       da[h, f]       = sum_i g[i, h] x[i, h F + f]  (H, F);   undefined unless need_a
//
// The backward is one pass over the rows for both gradients. Each part (one per thread) sums da
// over its own rows, and the parts are added in part order afterwards: the same result at the
// same thread count. torch's version of the same backward writes an (n, H F) temporary for da
// and reduces it over the rows.
#include "native.h"

#include <torch/library.h>

#include <vector>

namespace granii {
namespace {

constexpr int kLanes = 8;

// sum_f x[f] a[f] with kLanes independent partial sums (one vector register of floats).
template <typename T>
inline T dot(const T* __restrict x, const T* __restrict a, int64_t F) {
  T acc[kLanes] = {};
  int64_t f = 0;
  for (; f + kLanes <= F; f += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[f + l] * a[f + l];
  }
  T s = 0;
  for (; f < F; ++f) s += x[f] * a[f];
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

void check_args(const at::Tensor& x, const at::Tensor& a, const char* name) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 2, name, ": x must be (n, H F) and a (H, F)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble, name,
              ": float32 or float64 expected");
  check_dense(x, "x", name, x.scalar_type());
  check_dense(a, "a", name, x.scalar_type());
  TORCH_CHECK(x.size(1) == a.numel(), name, ": x has ", x.size(1), " columns, a holds ",
              a.numel(), " values");
}

at::Tensor head_dot(const at::Tensor& x, const at::Tensor& a) {
  const char* name = "granii::head_dot";
  check_args(x, a, name);
  const int64_t n = x.size(0), H = a.size(0), F = a.size(1);
  at::Tensor y = at::empty({n, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "granii::head_dot", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t parts = num_parts(0, n, 0, H * F);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t i = n * p / parts; i < n * (p + 1) / parts; ++i) {
          const scalar_t* xr = xp + i * H * F;
          for (int64_t h = 0; h < H; ++h) yp[i * H + h] = dot(xr + h * F, ap + h * F, F);
        }
      }
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> head_dot_backward(const at::Tensor& g, const at::Tensor& x,
                                                     const at::Tensor& a, bool need_x,
                                                     bool need_a) {
  const char* name = "granii::head_dot_backward";
  check_args(x, a, name);
  const int64_t n = x.size(0), H = a.size(0), F = a.size(1), W = H * F;
  check_dense(g, "g", name, x.scalar_type());
  TORCH_CHECK(g.dim() == 2 && g.size(0) == n && g.size(1) == H, name, ": g must be (n, H)");
  at::Tensor dx = need_x ? at::empty({n, W}, x.options()) : at::Tensor();
  at::Tensor da = need_a ? at::empty({H, F}, x.options()) : at::Tensor();
  if (!need_x && !need_a) return {dx, da};
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "granii::head_dot_backward", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    scalar_t* dxp = need_x ? dx.data_ptr<scalar_t>() : nullptr;
    const int64_t parts = num_parts(0, n, 0, W);
    std::vector<scalar_t> partial(need_a ? parts * W : 0, scalar_t(0));
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        scalar_t* __restrict acc = need_a ? partial.data() + p * W : nullptr;
        for (int64_t i = n * p / parts; i < n * (p + 1) / parts; ++i) {
          const scalar_t* __restrict xr = xp + i * W;
          for (int64_t h = 0; h < H; ++h) {
            const scalar_t gh = gp[i * H + h];
            const scalar_t* __restrict ah = ap + h * F;
            if (dxp) {
              scalar_t* __restrict d = dxp + i * W + h * F;
              for (int64_t f = 0; f < F; ++f) d[f] = gh * ah[f];
            }
            if (acc) {
              scalar_t* __restrict s = acc + h * F;
              const scalar_t* __restrict xh = xr + h * F;
              for (int64_t f = 0; f < F; ++f) s[f] += gh * xh[f];
            }
          }
        }
      }
    });
    if (need_a) {
      scalar_t* dap = da.data_ptr<scalar_t>();
      std::copy(partial.begin(), partial.begin() + W, dap);
      for (int64_t p = 1; p < parts; ++p) {
        const scalar_t* s = partial.data() + p * W;
        for (int64_t j = 0; j < W; ++j) dap[j] += s[j];
      }
    }
  });
  return {dx, da};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("head_dot(Tensor x, Tensor a) -> Tensor");
  m.def("head_dot_backward(Tensor g, Tensor x, Tensor a, bool need_x, bool need_a) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("head_dot", &head_dot);
  m.impl("head_dot_backward", &head_dot_backward);
}

}  // namespace granii
