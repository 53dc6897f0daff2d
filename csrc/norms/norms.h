// Shared front half of the norm ops: checks, views, output allocation and params. Every backend
// (norms_cpu.cpp, norms_cuda.cu) calls these, so all of them accept and reject the same inputs.
#pragma once

#include <ATen/ATen.h>

#include "norms/params.h"

namespace pathkernels {

// The public name the user called: pathkernels.residual_norm or pathkernels.composite_norm.
const char* norm_op_name(bool centered);

struct NormPartsPlan {
  at::Tensor x;       // [batch, rows, cols] view (or copy) of the input
  at::Tensor parts;   // [..., targets, kNumParts]
  at::Tensor argmax;  // [..., targets, kNumArgs]
  NormPartsParams params;
};

struct NormPartsBackwardPlan {
  at::Tensor x;             // [batch, rows, cols]
  at::Tensor grad_parts;    // contiguous
  at::Tensor parts;         // contiguous
  at::Tensor argmax;        // contiguous
  at::Tensor grad_x;        // [..., rows, cols], contiguous
  NormPartsBackwardParams params;
};

NormPartsPlan prepare_norm_parts(const at::Tensor& x, bool centered, bool with_norm);

NormPartsBackwardPlan prepare_norm_parts_backward(const at::Tensor& grad_parts, const at::Tensor& x,
                                                  const at::Tensor& parts, const at::Tensor& argmax,
                                                  bool centered, bool with_norm);

}  // namespace pathkernels
