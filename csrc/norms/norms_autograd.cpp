// Autograd of norm_parts, registered in C++ for every device. A Python-registered formula
// (torch.library.register_autograd) cost ~10 µs per call, grad mode or not: more than the whole
// CPU kernel on a 64 × 64 matrix. The gradient itself is the op norm_parts_backward.
#include <torch/autograd.h>
#include <torch/library.h>

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
