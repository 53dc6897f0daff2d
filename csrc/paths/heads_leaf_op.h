// The host side of `_heads_leaf_norms` shared by its backends (heads_leaf_cpu.cpp, heads_leaf_cuda.cu):
// input checks, layout and the kernel's parameters. The kernel itself is heads_leaf.h.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>

#include "paths/heads_leaf.h"

namespace pathkernels {

// The operands as the kernel reads them: attn C(A) [H, n, n] and attn_mean a [H, n] contiguous,
// right [n, c, m] with unit column stride and leaf stride m (any row stride), mean [c, m] with unit
// column stride, scale [c] float64 contiguous, all float32 but scale.
struct HeadsLeafOperands {
  at::Tensor attn;
  at::Tensor attn_mean;
  at::Tensor right;
  at::Tensor mean;
  at::Tensor scale;
  heads_leaf::Variant variant;
};

// Validates the inputs of _heads_leaf_norms (see registration.cpp), copying only operands that are
// not laid out as above. `scale` absent means 1 for every parent.
HeadsLeafOperands check_heads_leaf(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& right,
                                   const at::Tensor& mean, const std::optional<at::Tensor>& scale,
                                   c10::string_view kernel);

// The outputs [c, H] (float64) and, where m spans several column tiles, the cross-tile buffers:
// column maxima and row sums per tile (float32) and the arrival counters (int32, zero).
struct HeadsLeafBuffers {
  at::Tensor residual;
  at::Tensor norm;
  at::Tensor col_shares;
  at::Tensor row_shares;
  at::Tensor arrivals;
};

// Column tiles of m for `variant`.
int64_t heads_leaf_tiles(heads_leaf::Variant variant, int64_t m);

HeadsLeafBuffers heads_leaf_buffers(const HeadsLeafOperands& ops);

heads_leaf::Params heads_leaf_params(const HeadsLeafOperands& ops, HeadsLeafBuffers& buffers,
                                     int64_t parents_per_block);

}  // namespace pathkernels
