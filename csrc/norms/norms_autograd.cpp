// Autograd of norm_parts, registered in C++ for every device. A Python-registered formula
// (torch.library.register_autograd) cost ~10 µs per call, grad mode or not: more than the whole
// CPU kernel on a 64 × 64 matrix. The gradient itself is the op norm_parts_backward.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "common/norm_math.h"

namespace pathkernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor> call_norm_parts(const at::Tensor& x, bool centered, bool with_norm) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pathkernels::norm_parts", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, bool, bool)>();
  return op.call(x, centered, with_norm);
}

at::Tensor call_norm_parts_backward(const at::Tensor& grad_parts, const at::Tensor& x, const at::Tensor& parts,
                                    const at::Tensor& argmax, bool centered, bool with_norm) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pathkernels::norm_parts_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>();
  return op.call(grad_parts, x, parts, argmax, centered, with_norm);
}

// norm_parts_backward in differentiable ATen ops, for a backward that builds a graph
// (create_graph=True: Hessian-vector products, gradient penalties). The sign patterns are piecewise
// constant in x, so the second derivative flows through the coefficients alone: the incoming
// gradient and, through the composite's share, parts, which the graph holds as this node's output.
// The same formula as the kernels (norm_math.h: composite_backward, target_grad_element and the
// centring map), with their rounding up to the order of a few sums.
at::Tensor norm_parts_backward_with_graph(const at::Tensor& grad_parts, const at::Tensor& x, const at::Tensor& parts,
                                          const at::Tensor& argmax, bool centered, bool with_norm) {
  // The kernels' arithmetic type: half and bfloat16 accumulate in float.
  const at::ScalarType work = at::isReducedFloatingType(x.scalar_type()) ? at::kFloat : x.scalar_type();
  const at::Tensor values = x.detach().to(work);
  const at::Tensor grads = grad_parts.to(work), norms = parts.to(work);
  const int64_t n = x.size(-2), m = x.size(-1);
  at::Tensor grad_x = at::zeros_like(values, at::MemoryFormat::Contiguous);
  for (int64_t target = 0; target < num_targets(centered, with_norm); ++target) {
    const at::Tensor part = norms.select(-2, target), grad = grads.select(-2, target);  // [..., 3]
    const at::Tensor l1 = part.select(-1, kPartL1), linf = part.select(-1, kPartLinf);
    const at::Tensor composite = part.select(-1, kPartComposite);
    // composite_backward: the composite's gradient shared out onto (l1, linf), by coefficients
    // that are 0 at composite = 0 and where it overflowed (the kernels skip a zero gradient there
    // instead; here the result stays linear in the gradient, which may itself be differentiated).
    // A denominator of 1 keeps the unused branch, and so its derivative, finite.
    const at::Tensor usable = (composite > 0).logical_and(composite.isfinite());
    const at::Tensor twice = at::where(usable, 2 * composite, 1);
    const at::Tensor grad_composite = grad.select(-1, kPartComposite);
    const at::Tensor col_grad = grad.select(-1, kPartL1) + grad_composite * at::where(usable, linf / twice, 0);
    const at::Tensor row_grad = grad.select(-1, kPartLinf) + grad_composite * at::where(usable, l1 / twice, 0);
    const bool residual = centered && target == 0;
    const at::Tensor v = residual ? values - values.mean(-2, /*keepdim=*/true) : values;
    const at::Tensor sign = (v > 0).to(work) - (v < 0).to(work);  // abs_grad: 0 at 0 and NaN
    const at::Tensor col = argmax.select(-2, target).select(-1, kArgColumn).unsqueeze(-1).unsqueeze(-1);
    const at::Tensor row = argmax.select(-2, target).select(-1, kArgRow).unsqueeze(-1).unsqueeze(-1);
    std::vector<int64_t> column_shape(x.sizes().begin(), x.sizes().end()), row_shape = column_shape;
    column_shape.back() = 1;
    row_shape[row_shape.size() - 2] = 1;
    const at::Tensor col_index = col.expand(column_shape), row_index = row.expand(row_shape);
    at::Tensor g = at::zeros_like(values, at::MemoryFormat::Contiguous);
    if (m > 0) {
      g = g.scatter_add(-1, col_index, sign.gather(-1, col_index) * col_grad.unsqueeze(-1).unsqueeze(-1));
    }
    g = g.scatter_add(-2, row_index, sign.gather(-2, row_index) * row_grad.unsqueeze(-1).unsqueeze(-1));
    grad_x = grad_x + (residual ? g - g.sum(-2, /*keepdim=*/true) / static_cast<double>(n) : g);
  }
  return grad_x.to(x.scalar_type());
}

// d parts / d x is the sparse sign pattern of the maximal column and row of each target (and,
// centred, that pattern pushed through the centring map); argmax, which norm_parts returns, says
// where they are. argmax itself is not differentiable.
class NormParts : public torch::autograd::Function<NormParts> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, bool centered, bool with_norm) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [parts, argmax] = call_norm_parts(x, centered, with_norm);
    ctx->save_for_backward({x, parts, argmax});
    ctx->saved_data["centered"] = centered;
    ctx->saved_data["with_norm"] = with_norm;
    ctx->mark_non_differentiable({argmax});
    return {parts, argmax};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    if (at::GradMode::is_enabled()) {  // create_graph: a backward that can itself be differentiated
      return {norm_parts_backward_with_graph(grads[0], saved[0], saved[1], saved[2],
                                             ctx->saved_data["centered"].toBool(),
                                             ctx->saved_data["with_norm"].toBool()),
              at::Tensor(), at::Tensor()};
    }
    const at::Tensor grad_x = call_norm_parts_backward(grads[0], saved[0], saved[1], saved[2],
                                                       ctx->saved_data["centered"].toBool(),
                                                       ctx->saved_data["with_norm"].toBool());
    return {grad_x, at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> norm_parts_autograd(const at::Tensor& x, bool centered, bool with_norm) {
  const variable_list out = NormParts::apply(x, centered, with_norm);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, Autograd, m) {
  m.impl("norm_parts", &norm_parts_autograd);
}

}  // namespace pathkernels
