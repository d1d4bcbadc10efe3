// The cost models' tree ensembles evaluated row by row (granii.learned.Trees.predict).
//
//   granii::forest_predict(left, right, feature, cond, default_left, x, depth) -> (rows,) float64
//       One ensemble of T trees stored as (T, W) arrays: node j of tree t sends a row left when
//       x[feature[t, j]] < cond[t, j] (float32, as XGBoost compares; NaN goes by default_left),
//       a leaf (left[t, j] < 0) holds its value in cond[t, j]. Returns, per row of x (rows, F),
//       the sum over the trees of the leaf reached, added in tree order in float64. A walk stops
//       at a leaf or after `depth` steps, so a cyclic or too deep tree cannot loop; an index out
//       of its array raises instead of reading past it. Indices int64 or int32 (the cache of
//       parsed models keeps int32, read without a copy), default_left bool or int32.
//
//   granii::forest_predict_flat(flat, x) -> (rows,) float64
//       The same walk over an ensemble kept as one int32 array, as the cache of parsed models
//       stores it (granii.learned._cached_trees): magic, format, num_features, depth, T, W, then
//       left, right, feature, the bits of the float32 cond, default_left, each T x W. One mapped
//       file is one tensor: a first call's dozen models cost no per-array tensors.
//
// numpy walks all trees one level at a time with a dozen array operations per level: about
// 0.1 ms for one row, whatever the tree count. Ranking a layer's plans predicts a few dozen
// rows one at a time, so the walk here (microseconds per row, one thread) is what keeps the
// decision a small part of a first call.
#include "native.h"

#include <torch/library.h>

#include <cmath>

namespace granii {
namespace {

template <typename index_t, typename flag_t>
void walk(const index_t* lp, const index_t* rp, const index_t* fp, const float* cp,
          const flag_t* dp, const float* xp, int64_t trees, int64_t width, int64_t rows,
          int64_t nf, int64_t depth, double* op, const char* name) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * nf;
    double sum = 0.0;
    for (int64_t t = 0; t < trees; ++t) {
      const int64_t base = t * width;
      int64_t node = 0;
      for (int64_t step = 0; step < depth && width > 0; ++step) {
        const int64_t l = lp[base + node];
        if (l < 0) break;
        const int64_t f = fp[base + node];
        TORCH_CHECK(f >= 0 && f < nf, name, ": a split reads feature ", f, " of ", nf);
        const float v = xr[f];
        const bool go_left = std::isnan(v) ? dp[base + node] != 0 : v < cp[base + node];
        node = go_left ? l : static_cast<int64_t>(rp[base + node]);
        TORCH_CHECK(node >= 0 && node < width, name, ": tree ", t, " points to node ", node,
                    " of ", width);
      }
      if (width > 0) sum += static_cast<double>(cp[base + node]);
    }
    op[r] = sum;
  }
}

template <typename index_t>
void walk_flags(const at::Tensor& left, const at::Tensor& right, const at::Tensor& feature,
                const at::Tensor& cond, const at::Tensor& default_left, const at::Tensor& x,
                int64_t depth, double* op, const char* name) {
  const int64_t trees = left.size(0), width = left.size(1);
  const int64_t rows = x.size(0), nf = x.size(1);
  const index_t* lp = left.data_ptr<index_t>();
  const index_t* rp = right.data_ptr<index_t>();
  const index_t* fp = feature.data_ptr<index_t>();
  if (default_left.scalar_type() == at::kBool) {
    walk(lp, rp, fp, cond.data_ptr<float>(), default_left.data_ptr<bool>(), x.data_ptr<float>(),
         trees, width, rows, nf, depth, op, name);
  } else {
    walk(lp, rp, fp, cond.data_ptr<float>(), default_left.data_ptr<int32_t>(),
         x.data_ptr<float>(), trees, width, rows, nf, depth, op, name);
  }
}

at::Tensor forest_predict(const at::Tensor& left, const at::Tensor& right,
                          const at::Tensor& feature, const at::Tensor& cond,
                          const at::Tensor& default_left, const at::Tensor& x, int64_t depth) {
  const char* name = "forest_predict";
  TORCH_CHECK(left.dim() == 2, name, ": tree arrays must be (trees, nodes)");
  for (const at::Tensor* t : {&left, &right, &feature, &cond, &default_left}) {
    TORCH_CHECK(t->sizes() == left.sizes() && t->is_contiguous() && t->device().is_cpu(), name,
                ": tree arrays must share one shape and be contiguous CPU arrays");
  }
  const auto it = left.scalar_type();
  TORCH_CHECK((it == at::kLong || it == at::kInt) && right.scalar_type() == it &&
                  feature.scalar_type() == it,
              name, ": child and feature indices must be int64 or int32, all alike");
  TORCH_CHECK(cond.scalar_type() == at::kFloat, name, ": conditions must be float32");
  TORCH_CHECK(default_left.scalar_type() == at::kBool || default_left.scalar_type() == at::kInt,
              name, ": default_left must be bool or int32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu(),
              name, ": x must be a contiguous (rows, features) float32 CPU array");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kDouble));
  double* op = out.data_ptr<double>();
  if (it == at::kLong) {
    walk_flags<int64_t>(left, right, feature, cond, default_left, x, depth, op, name);
  } else {
    walk_flags<int32_t>(left, right, feature, cond, default_left, x, depth, op, name);
  }
  return out;
}

at::Tensor forest_predict_flat(const at::Tensor& flat, const at::Tensor& x) {
  const char* name = "forest_predict_flat";
  TORCH_CHECK(flat.dim() == 1 && flat.scalar_type() == at::kInt && flat.is_contiguous() &&
                  flat.device().is_cpu() && flat.numel() >= 6,
              name, ": the ensemble must be a contiguous int32 CPU array with its 6-value header");
  const int32_t* p = flat.data_ptr<int32_t>();
  const int64_t nf = p[2], depth = p[3], trees = p[4], width = p[5];
  TORCH_CHECK(trees >= 1 && width >= 1 && depth >= 0 && flat.numel() == 6 + 5 * trees * width,
              name, ": the header does not match the array's length");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu() && x.size(1) == nf,
              name, ": x must be a contiguous (rows, ", nf, ") float32 CPU array");
  const int64_t n = trees * width;
  const int32_t* body = p + 6;
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kDouble));
  walk(body, body + n, body + 2 * n, reinterpret_cast<const float*>(body + 3 * n), body + 4 * n,
       x.data_ptr<float>(), trees, width, x.size(0), nf, depth, out.data_ptr<double>(), name);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(granii, m) {
  m.def("forest_predict(Tensor left, Tensor right, Tensor feature, Tensor cond, "
        "Tensor default_left, Tensor x, int depth) -> Tensor");
  m.def("forest_predict_flat(Tensor flat, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(granii, CPU, m) {
  m.impl("forest_predict", &forest_predict);
  m.impl("forest_predict_flat", &forest_predict_flat);
}

}  // namespace granii
