// Kernel interface of the norm ops: plain pointers, element strides and sizes, no at::Tensor.
#pragma once

#include <cstdint>

namespace pathkernels {

// x is viewed as [batch, rows, cols] with arbitrary element strides.
struct MatrixBatch {
  int64_t batch = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t col_stride = 0;
};

struct NormPartsParams {
  const void* x = nullptr;  // [batch, rows, cols], strides in `shape`
  MatrixBatch shape;
  bool centered = false;    // measure x − 1·meanᵀ (target 0) and, with with_norm, x itself (target 1)
  bool with_norm = true;    // ignored unless centered: x itself is always measured when not centred
  void* parts = nullptr;    // [batch, targets, kNumParts], contiguous, x's dtype
  int64_t* argmax = nullptr;  // [batch, targets, kNumArgs], contiguous
};

struct NormPartsBackwardParams {
  const void* x = nullptr;           // [batch, rows, cols], strides in `shape`
  MatrixBatch shape;
  bool centered = false;
  bool with_norm = true;
  const void* grad_parts = nullptr;  // [batch, targets, kNumParts], contiguous, x's dtype
  const void* parts = nullptr;       // [batch, targets, kNumParts], contiguous, x's dtype
  const int64_t* argmax = nullptr;   // [batch, targets, kNumArgs], contiguous
  void* grad_x = nullptr;            // [batch, rows, cols], contiguous, x's dtype
};

}  // namespace pathkernels
