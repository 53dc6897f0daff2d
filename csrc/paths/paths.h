// The path-tree engine's shared front: checks of one chunk's inputs, for every backend.
#pragma once

#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

#include "paths/fused_leaf.h"

namespace pathkernels {

// One chunk of a path tree, breadth-first: level l (1..L) holds N_l nodes sorted by the head they
// take (−1 = skip first); parents[l−1][k] is node k's parent position in level l−1, heads[l−1][k]
// its head. The last level's nodes are the leaves.
struct PathChunk {
  std::vector<at::Tensor> parents;  // L × [N_l] int64
  std::vector<at::Tensor> heads;    // L × [N_l] int64
};

// How the CUDA engine reduces leaves of n <= fused_leaf::kMaxRows rows (the ops' `leaf_kernel`;
// the CPU engine reduces every leaf block in cache and ignores it):
//   "simt":   the fused leaf kernel on CUDA cores (fused_leaf.h), any dtype;
//   "tf32x3": the fused leaf kernel on tensor cores at float32 accuracy (tensor_leaf.h), float32;
//   "tf32":   the same with one TF32 pass (about 2^-11 relative per product), float32;
//   "gemm":   cuBLAS into a scratch block, then three reduction kernels (path_chunk_norms only).
enum class LeafKernel { kSimt, kTf32x3, kTf32, kGemm };

// `name` as a LeafKernel, refusing unknown names, tensor-core kernels for dtypes other than
// float32 and, unless allow_gemm, "gemm"; `op` and `argument` name the caller in errors.
LeafKernel parse_leaf_kernel(c10::string_view name, at::ScalarType dtype, bool allow_gemm, const char* op,
                             const char* argument);

// Validates the inputs of path_chunk_norms (see registration.cpp) and returns the chunk's levels
// as CPU int64 tensors.
PathChunk check_path_chunk(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& root,
                           const at::Tensor& root_mean, const std::optional<at::Tensor>& w_v,
                           const std::optional<at::Tensor>& w_o, at::TensorList parents, at::TensorList heads,
                           int64_t leaf_block);

// The fused leaf reduction's operands: attn C(A) [n, n] contiguous, right [n, c, m] with unit
// column stride and leaf stride m (any row stride), mean [c, m] with unit column stride, and the
// leaves' scales [c], float64, contiguous (leaf k is R_k = scale[k] · C(A) right_k).
struct FusedLeafOperands {
  at::Tensor attn;
  at::Tensor right;
  at::Tensor mean;
  at::Tensor scale;
  LeafKernel kernel;
};

// Validates the inputs of _fused_leaf_norms (see registration.cpp) and lays them out as the
// kernel reads them (copying only when they are not already).
// `scale` absent means 1 for every leaf.
FusedLeafOperands check_fused_leaf(const at::Tensor& attn, const at::Tensor& right, const at::Tensor& mean,
                                   const std::optional<at::Tensor>& scale, c10::string_view kernel);

// The kernel's parameters for `ops`, with its column and row sum buffers.
fused_leaf::Params fused_leaf_params(const FusedLeafOperands& ops, const at::Tensor& col_stats,
                                     const at::Tensor& row_stats);

// Column sums [c, m, kStats] and row sums [c, tiles, n, kStats] in the accumulation type of `ops`.
std::tuple<at::Tensor, at::Tensor> fused_leaf_buffers(const FusedLeafOperands& ops);

}  // namespace pathkernels
