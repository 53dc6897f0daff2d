// The path-tree engine's shared front: checks of one chunk's inputs, for every backend.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace pathkernels {

// One chunk of a path tree, breadth-first: level l (1..L) holds N_l nodes sorted by the head they
// take (−1 = skip first); parents[l−1][k] is node k's parent position in level l−1, heads[l−1][k]
// its head. The last level's nodes are the leaves.
struct PathChunk {
  std::vector<at::Tensor> parents;  // L × [N_l] int64
  std::vector<at::Tensor> heads;    // L × [N_l] int64
};

// Validates the inputs of path_chunk_norms (see registration.cpp) and returns the chunk's levels
// as CPU int64 tensors.
PathChunk check_path_chunk(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& root,
                           const at::Tensor& root_mean, const std::optional<at::Tensor>& w_v,
                           const std::optional<at::Tensor>& w_o, at::TensorList parents, at::TensorList heads,
                           int64_t leaf_block);

}  // namespace pathkernels
