// The readout of a batch of graphs with its gradient in C++ (kernels/readout.py).
//
//   granii::segment_sum(x, indptr, indices, graph_of_node, scale=None) -> y
//       y = diag(scale) R x, with R the CSR (indptr, indices) that holds a one at each node of
//       each graph (one row per graph), x (N, width): the native SpMM (spmm_csr) sums each
//       graph's rows, scale (G,) or None (ones) scales them. Differentiable in x:
//       dx = R^T diag(scale) dy = (diag(scale) dy)[graph_of_node], graph_of_node (N,) int64 the
//       graph of each node.
//
// The same as the Python autograd function it stands for, without a Python frame in the forward
// or the backward: a batch of small graphs reads out after every layer, and each readout's own
// work is a few microseconds, less than the Python around it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace granii {
namespace {

at::Tensor spmm_rows(const at::Tensor& indptr, const at::Tensor& indices, const at::Tensor& x3,
                     const c10::optional<at::Tensor>& scale) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("granii::spmm_csr", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                            const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                            const c10::optional<at::Tensor>&, int64_t, int64_t,
                            const c10::optional<at::Tensor>&)>();
  return op.call(indptr, indices, x3, c10::nullopt, c10::nullopt, scale, c10::nullopt,
                 c10::nullopt, 0, 0, c10::nullopt);
}

class SegmentSum : public torch::autograd::Function<SegmentSum> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& indptr, const at::Tensor& indices,
                            const at::Tensor& graph_of_node,
                            const c10::optional<at::Tensor>& scale) {
    TORCH_CHECK(x.dim() == 2, "granii::segment_sum: x must be (nodes, width)");
    TORCH_CHECK(graph_of_node.dim() == 1 && graph_of_node.size(0) == x.size(0) &&
                    graph_of_node.scalar_type() == at::kLong,
                "granii::segment_sum: graph_of_node must hold one int64 per row of x");
    ctx->save_for_backward({graph_of_node, scale.has_value() ? *scale : at::Tensor()});
    const int64_t n = x.size(0), width = x.size(1);
    return spmm_rows(indptr, indices, x.contiguous().reshape({n, 1, width}), scale)
        .reshape({indptr.numel() - 1, width});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor g = grads[0];
    if (saved[1].defined()) g = g * saved[1].unsqueeze(1);
    return {g.index_select(0, saved[0]), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor segment_sum(const at::Tensor& x, const at::Tensor& indptr, const at::Tensor& indices,
                       const at::Tensor& graph_of_node, const c10::optional<at::Tensor>& scale) {
  return SegmentSum::apply(x, indptr, indices, graph_of_node, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def(
      "segment_sum(Tensor x, Tensor indptr, Tensor indices, Tensor graph_of_node, "
      "Tensor? scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CompositeImplicitAutograd, m) {
  m.impl("segment_sum", &segment_sum);
}

}  // namespace granii
