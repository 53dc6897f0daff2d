#include "norms/norms.h"

#include <algorithm>

#include "common/checks.h"
#include "common/norm_math.h"

namespace pathkernels {
namespace {

// Views x [..., n, m] as [batch, n, m]; copies only when the leading dims cannot be merged.
at::Tensor as_matrix_batch(const at::Tensor& x, MatrixBatch& shape) {
  shape.rows = x.size(-2);
  shape.cols = x.size(-1);
  shape.batch = 1;
  for (int64_t d = 0; d < x.dim() - 2; ++d) {
    shape.batch *= x.size(d);
  }
  at::Tensor x3 = x.reshape({shape.batch, shape.rows, shape.cols});
  shape.batch_stride = x3.stride(0);
  shape.row_stride = x3.stride(1);
  shape.col_stride = x3.stride(2);
  return x3;
}

std::vector<int64_t> leading_shape_with(const at::Tensor& x, int64_t targets, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
  shape.push_back(targets);
  shape.push_back(last);
  return shape;
}

void check_norm_input(const at::Tensor& x, const char* op) {
  check_min_dim(x, 2, op, "x", "[..., n, m]");
  check_floating(x, op, "x");
  TORCH_CHECK_VALUE(x.size(-2) > 0, op, ": expected x to have at least one row (n >= 1) in [..., n, m], got shape ",
                    shape_string(x.sizes()));
}

}  // namespace

const char* norm_op_name(bool centered) {
  return centered ? "pathkernels.residual_norm" : "pathkernels.composite_norm";
}

NormPartsPlan prepare_norm_parts(const at::Tensor& x, bool centered, bool with_norm) {
  const char* op = norm_op_name(centered);
  check_norm_input(x, op);
  NormPartsPlan plan;
  plan.x = as_matrix_batch(x, plan.params.shape);
  const int64_t targets = num_targets(centered, with_norm);
  plan.parts = at::empty(leading_shape_with(x, targets, kNumParts), x.options());
  plan.argmax = at::empty(leading_shape_with(x, targets, kNumArgs), x.options().dtype(at::kLong));
  plan.params.x = plan.x.const_data_ptr();
  plan.params.centered = centered;
  plan.params.with_norm = with_norm;
  plan.params.parts = plan.parts.mutable_data_ptr();
  plan.params.argmax = plan.argmax.mutable_data_ptr<int64_t>();
  return plan;
}

NormPartsBackwardPlan prepare_norm_parts_backward(const at::Tensor& grad_parts, const at::Tensor& x,
                                                  const at::Tensor& parts, const at::Tensor& argmax,
                                                  bool centered, bool with_norm) {
  const char* op = norm_op_name(centered);
  check_norm_input(x, op);
  const int64_t targets = num_targets(centered, with_norm);
  const auto expected_parts = leading_shape_with(x, targets, kNumParts);
  const auto expected_argmax = leading_shape_with(x, targets, kNumArgs);
  TORCH_CHECK_VALUE(grad_parts.sizes() == at::IntArrayRef(expected_parts) &&
                        parts.sizes() == at::IntArrayRef(expected_parts),
                    op, " backward: expected grad_parts and parts of shape ", shape_string(expected_parts),
                    ", got ", shape_string(grad_parts.sizes()), " and ", shape_string(parts.sizes()));
  TORCH_CHECK_VALUE(argmax.sizes() == at::IntArrayRef(expected_argmax) && argmax.scalar_type() == at::kLong,
                    op, " backward: expected int64 argmax of shape ", shape_string(expected_argmax),
                    ", got ", dtype_name(argmax.scalar_type()), " ", shape_string(argmax.sizes()));
  check_same_device(grad_parts, x, op, "grad_parts", "x");
  check_same_device(parts, x, op, "parts", "x");
  check_same_device(argmax, x, op, "argmax", "x");
  // The kernels read x and write grad_x at these positions; an empty matrix (m = 0) reports column 0.
  check_index_range(argmax.select(-1, kArgColumn), 0, std::max<int64_t>(x.size(-1), 1), op,
                    "argmax[..., 0] (the column of ‖v‖_1)");
  check_index_range(argmax.select(-1, kArgRow), 0, x.size(-2), op, "argmax[..., 1] (the row of ‖v‖_∞)");

  NormPartsBackwardPlan plan;
  plan.x = as_matrix_batch(x, plan.params.shape);
  plan.grad_parts = grad_parts.to(x.scalar_type()).contiguous();
  plan.parts = parts.to(x.scalar_type()).contiguous();
  plan.argmax = argmax.contiguous();
  plan.grad_x = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  plan.params.x = plan.x.const_data_ptr();
  plan.params.centered = centered;
  plan.params.with_norm = with_norm;
  plan.params.grad_parts = plan.grad_parts.const_data_ptr();
  plan.params.parts = plan.parts.const_data_ptr();
  plan.params.argmax = plan.argmax.const_data_ptr<int64_t>();
  plan.params.grad_x = plan.grad_x.mutable_data_ptr();
  return plan;
}

}  // namespace pathkernels
