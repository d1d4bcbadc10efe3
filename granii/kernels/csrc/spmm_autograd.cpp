// The plain native SpMM with its gradient in C++ (kernels/native.py, ``_run``).
//
//   granii::spmm_autograd(x, indptr, indices, t_indptr, t_indices, row_scale=None,
//                         col_scale=None, act=0, res=None, heads=1) -> y
//       y = act(diag(r) M diag(c) X + R), M the CSR (indptr, indices) with rows the result's
//       rows, (t_indptr, t_indices) the CSR of M^T, X the rows of x (n, ...) read as
//       (n, heads, K), R (rows, heads K) or None, act 0 (none) or 1 (relu); y (rows, heads, K).
//       Differentiable in x and res (the scales are constants here: kernels/native.py takes its
//       Python autograd function where they need gradients):
//           P = act'(y) dy,  dX = diag(c) M^T diag(r) P,  dR = P
//       dX by this operator on M^T with the scales swapped, so a double backward differentiates
//       through it; without one, by the kernel alone, returned in x's shape as a tensor of its
//       own (not a view), which autograd can add another gradient into in place.
//
// The same as the Python autograd function it stands for in that case, without a Python frame
// in the forward or the backward: on the small graphs of a batch (graph classification) a layer's
// product takes a few microseconds, less than the Python around it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace granii {
namespace {

using OptTensor = c10::optional<at::Tensor>;

at::Tensor spmm_csr_call(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& x3,
                         const OptTensor& row_scale, const OptTensor& col_scale, int64_t act,
                         const OptTensor& res) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("granii::spmm_csr", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, const OptTensor&, const OptTensor&,
                            const OptTensor&, const OptTensor&, int64_t, int64_t,
                            const OptTensor&)>();
  return op.call(indptr, indices, x3, c10::nullopt, c10::nullopt, row_scale, col_scale,
                 c10::nullopt, act, 0, res);
}

OptTensor maybe(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

at::Tensor spmm_autograd(const at::Tensor& x, const at::Tensor& indptr, const at::Tensor& indices,
                         const at::Tensor& t_indptr, const at::Tensor& t_indices,
                         const OptTensor& row_scale, const OptTensor& col_scale, int64_t act,
                         const OptTensor& res, int64_t heads);

class SpmmFn : public torch::autograd::Function<SpmmFn> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& indptr, const at::Tensor& indices,
                            const at::Tensor& t_indptr, const at::Tensor& t_indices,
                            const OptTensor& row_scale, const OptTensor& col_scale, int64_t act,
                            const OptTensor& res, int64_t heads) {
    TORCH_CHECK(x.dim() >= 1 && heads >= 1, "granii::spmm_autograd: x must be (n, ...)");
    TORCH_CHECK(act == 0 || act == 1, "granii::spmm_autograd: act must be 0 or 1");
    const at::Tensor x3 = x.reshape({x.size(0), heads, -1}).contiguous();
    at::Tensor y = spmm_csr_call(indptr, indices, x3, row_scale, col_scale, act, res);
    ctx->save_for_backward({indptr, indices, t_indptr, t_indices,
                            row_scale.has_value() ? *row_scale : at::Tensor(),
                            col_scale.has_value() ? *col_scale : at::Tensor(),
                            act ? y : at::Tensor()});
    ctx->saved_data["act"] = act;
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["res"] = res.has_value() && res->defined();
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const int64_t act = ctx->saved_data["act"].toInt();
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    at::Tensor p = grads[0].contiguous();
    if (act) p = at::threshold_backward(p, s[6], 0);
    at::Tensor dx, dres;
    if (ctx->needs_input_grad(0)) {
      if (at::GradMode::is_enabled()) {  // a double backward: differentiable, on M^T
        dx = spmm_autograd(p, s[2], s[3], s[0], s[1], maybe(s[5]), maybe(s[4]), 0, c10::nullopt,
                           heads)
                 .reshape(x_sizes);
      } else {
        const at::Tensor g = spmm_csr_call(s[2], s[3], p, maybe(s[5]), maybe(s[4]), 0,
                                           c10::nullopt);
        dx = at::empty({0}, g.options()).set_(g.storage(), g.storage_offset(), x_sizes,
                                               c10::contiguous_strides(x_sizes));
      }
    }
    // a view of P, no work: given where res was (autograd drops it where res needs none)
    if (ctx->saved_data["res"].toBool()) dres = p.reshape({p.size(0), -1});
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), dres, at::Tensor()};
  }
};

at::Tensor spmm_autograd(const at::Tensor& x, const at::Tensor& indptr, const at::Tensor& indices,
                         const at::Tensor& t_indptr, const at::Tensor& t_indices,
                         const OptTensor& row_scale, const OptTensor& col_scale, int64_t act,
                         const OptTensor& res, int64_t heads) {
  return SpmmFn::apply(x, indptr, indices, t_indptr, t_indices, row_scale, col_scale, act, res,
                       heads);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def(
      "spmm_autograd(Tensor x, Tensor indptr, Tensor indices, Tensor t_indptr, "
      "Tensor t_indices, Tensor? row_scale=None, Tensor? col_scale=None, int act=0, "
      "Tensor? res=None, int heads=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CompositeImplicitAutograd, m) {
  m.impl("spmm_autograd", &spmm_autograd);
}

}  // namespace granii
