// The path-tree engine, device-generic: one call evaluates one chunk of a path tree, breadth-
// first. Every level is a handful of large GEMMs (one per block of nodes sharing a head, through
// ATen: MKL/OpenBLAS on CPU, cuBLAS on CUDA), and the leaves are reduced to their norms block by
// block by the backend (paths_cpu.cpp, paths_cuda.cu); no leaf matrix outlives its block.
//
// What travels down the tree (docs/DESIGN.md §1): the residual R = C(P) (or C(P X W)), never the product,
// so tiny residuals keep their relative precision; R_child = C(A) R_parent (W), with C(A) given.
// The column mean μ of the full product follows μ_child = (μ_parent + R_parentᵀ a) W, a = 1ᵀA/n,
// and the product itself is 1μᵀ + R.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>
#include <vector>

#include "paths/paths.h"

namespace pathkernels::engine {

// Consecutive nodes of one level that take the same head.
struct HeadRun {
  int64_t head;
  int64_t begin;
  int64_t end;
};

inline std::vector<HeadRun> head_runs(const at::Tensor& heads) {
  const int64_t* h = heads.const_data_ptr<int64_t>();
  std::vector<HeadRun> runs;
  for (int64_t k = 0; k < heads.numel(); ++k) {
    if (runs.empty() || runs.back().head != h[k]) {
      runs.push_back({h[k], k, k + 1});
    } else {
      runs.back().end = k + 1;
    }
  }
  return runs;
}

// The parents of a block: a view of the level when their positions are consecutive (always so in
// complete trees), otherwise a gathered copy. `positions` is the level's on the host (for the scan),
// copied to the level's device only for a gather.
inline std::pair<at::Tensor, at::Tensor> run_parents(const at::Tensor& level, const at::Tensor& level_mean,
                                                     const at::Tensor& positions, int64_t begin, int64_t count) {
  const int64_t* p = positions.const_data_ptr<int64_t>() + begin;
  bool consecutive = true;
  for (int64_t k = 1; k < count && consecutive; ++k) {
    consecutive = p[k] == p[0] + k;
  }
  if (consecutive) {
    return {level.narrow(1, p[0], count), level_mean.narrow(0, p[0], count)};
  }
  const at::Tensor index = positions.narrow(0, begin, count).to(level.device());
  return {level.index_select(1, index), level_mean.index_select(0, index)};
}

// The operands of one batch element.
struct Network {
  at::Tensor attn;       // [L, H, n, n], centred: C(A) = A − 1aᵀ
  at::Tensor attn_mean;  // [L, H, n], a = 1ᵀA/n
  std::optional<at::Tensor> w_v;  // [L, H, d, d_head]
  std::optional<at::Tensor> w_o;  // [L, H, d_head, d]
};

// What a child block multiplies C(A[layer, head]) by, and its column means: with W, right =
// R_parent W and μ = (μ_parent + R_parentᵀ a) W; without, right = R_parent (a view) and
// μ = μ_parent + R_parentᵀ a. `right` is [n, c, m] with unit column stride and leaf stride m.
struct ChildOperands {
  at::Tensor right;
  at::Tensor mean;
};

inline ChildOperands child_operands(const Network& net, int64_t layer, int64_t head, const at::Tensor& parents,
                                    const at::Tensor& parent_mean) {
  const int64_t n = parents.size(0), c = parents.size(1), m = parents.size(2);
  // One GEMM with beta = 1 (one launch on CUDA): [μ_parent …] + aᵀ [R_parent …], all c at once.
  at::Tensor mean = at::addmm(parent_mean.reshape({1, c * m}), net.attn_mean[layer][head].unsqueeze(0),
                              parents.flatten(1))
                        .view({c, m});
  if (!net.w_v.has_value()) {
    return {parents, mean};
  }
  const at::Tensor w_v = (*net.w_v)[layer][head];
  const at::Tensor w_o = (*net.w_o)[layer][head];
  return {parents.reshape({n * c, m}).mm(w_v).mm(w_o).view({n, c, m}), mean.mm(w_v).mm(w_o)};
}

// Children of `parents` [n, c, m] (means [c, m]) through head `head` of layer `layer`, written to
// `out` [n, c, m] and `out_mean` [c, m]. The skip branch copies.
inline void children(const Network& net, int64_t layer, int64_t head, const at::Tensor& parents,
                     const at::Tensor& parent_mean, at::Tensor out, at::Tensor out_mean) {
  if (head < 0) {
    out.copy_(parents);
    out_mean.copy_(parent_mean);
    return;
  }
  const ChildOperands operands = child_operands(net, layer, head, parents, parent_mean);
  at::Tensor out_rows = out.flatten(1);  // [n, c·m] with the level's row stride: a view, no copy
  TORCH_INTERNAL_ASSERT(out_rows.is_alias_of(out));
  at::mm_out(out_rows, net.attn[layer][head], operands.right.flatten(1));
  out_mean.copy_(operands.mean);
}

// A block of at most leaf_block consecutive nodes of one head run: the unit of parallel work.
// Blocks keep each GEMM's operands in cache (a 64 × 64 by 64 × 2^20 product runs at a third of
// the speed of the same work in 64 × 2048 pieces), and each thread runs its own blocks' GEMMs.
struct NodeBlock {
  int64_t head;
  int64_t begin;
  int64_t count;
};

inline std::vector<NodeBlock> node_blocks(const at::Tensor& heads, int64_t leaf_block) {
  std::vector<NodeBlock> blocks;
  for (const HeadRun& run : head_runs(heads)) {
    for (int64_t begin = run.begin; begin < run.end; begin += leaf_block) {
      blocks.push_back({run.head, begin, std::min(leaf_block, run.end - begin)});
    }
  }
  return blocks;
}

// The leaf children of `parents` through `head`, reduced by the backend's fused kernel where it
// has one and it applies; false otherwise (the caller then multiplies and reduces).
template <typename T, typename Backend>
bool fused_leaf_norms(Backend& backend, const Network& net, int64_t layer, int64_t head, const at::Tensor& parents,
                      const at::Tensor& parent_mean, T* residual, T* norm) {
  if constexpr (Backend::kFusedLeaves) {
    if (backend.fuses_leaves(parents.size(0))) {
      backend.fused_leaf_norms(net.attn[layer][head], child_operands(net, layer, head, parents, parent_mean),
                               residual, norm);
      return true;
    }
  }
  return false;
}

// One chunk for one batch element. Backend provides
//   for_each_block(count, fn): calls fn(block, worker) for every block (in parallel or not),
//   workers(): how many distinct `worker` values fn may see,
//   reduce(leaves [n, c, m], means [c, m], residual, norm): the leaves' norms into c outputs each,
// and, where kFusedLeaves, fuses_leaves(n) and fused_leaf_norms(attn [n, n], operands, residual,
// norm): the norms of the leaves C(A) · operands.right, computed without storing them.
template <typename T, typename Backend>
void evaluate_chunk(const Network& net, const at::Tensor& root, const at::Tensor& root_mean, const PathChunk& chunk,
                    int64_t leaf_block, T* residual, T* norm, Backend& backend) {
  const int64_t layers = static_cast<int64_t>(chunk.parents.size());
  const int64_t n = root.size(0), m = root.size(1);
  at::Tensor level = root.unsqueeze(1);            // [n, N_l, m]
  at::Tensor level_mean = root_mean.unsqueeze(0);  // [N_l, m]
  // Per-worker leaf blocks: computed, reduced, overwritten; never a whole level of leaves.
  std::vector<at::Tensor> scratch(backend.workers()), scratch_mean(backend.workers());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& positions = chunk.parents[l];
    const bool leaves = l + 1 == layers;
    at::Tensor next, next_mean;
    if (!leaves) {
      next = at::empty({n, positions.numel(), m}, root.options());
      next_mean = at::empty({positions.numel(), m}, root.options());
    }
    const std::vector<NodeBlock> blocks = node_blocks(chunk.heads[l], leaf_block);
    backend.for_each_block(static_cast<int64_t>(blocks.size()), [&](int64_t k, int worker) {
      const NodeBlock& blk = blocks[k];
      auto [parents, parent_mean] = run_parents(level, level_mean, positions, blk.begin, blk.count);
      if (!leaves) {
        children(net, l, blk.head, parents, parent_mean, next.narrow(1, blk.begin, blk.count),
                 next_mean.narrow(0, blk.begin, blk.count));
      } else if (blk.head < 0) {  // a skip leaf is its parent: reduce it where it lies
        backend.reduce(parents, parent_mean, residual + blk.begin, norm + blk.begin);
      } else if (!fused_leaf_norms(backend, net, l, blk.head, parents, parent_mean, residual + blk.begin,
                                   norm + blk.begin)) {
        if (!scratch[worker].defined()) {
          scratch[worker] = at::empty({n, leaf_block, m}, root.options());
          scratch_mean[worker] = at::empty({leaf_block, m}, root.options());
        }
        at::Tensor out = scratch[worker].narrow(1, 0, blk.count);
        at::Tensor out_mean = scratch_mean[worker].narrow(0, 0, blk.count);
        children(net, l, blk.head, parents, parent_mean, out, out_mean);
        backend.reduce(out, out_mean, residual + blk.begin, norm + blk.begin);
      }
    });
    if (!leaves) {
      level = next;
      level_mean = next_mean;
    }
  }
}

// The whole op for one backend: checks, outputs on attn's device, one chunk per batch element.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> path_chunk_norms(const at::Tensor& attn, const at::Tensor& attn_mean,
                                                    const at::Tensor& root, const at::Tensor& root_mean,
                                                    const std::optional<at::Tensor>& w_v,
                                                    const std::optional<at::Tensor>& w_o, at::TensorList parents,
                                                    at::TensorList heads, int64_t leaf_block, bool fused_leaves) {
  const PathChunk chunk = check_path_chunk(attn, attn_mean, root, root_mean, w_v, w_o, parents, heads, leaf_block);
  const int64_t batch = attn.size(0);
  const int64_t leaves = chunk.parents.back().numel();
  at::Tensor residual = at::empty({batch, leaves}, attn.options());
  at::Tensor norm = at::empty({batch, leaves}, attn.options());
  const at::Tensor attn_c = attn.contiguous();
  const at::Tensor attn_mean_c = attn_mean.contiguous();
  const at::Tensor root_c = root.contiguous();
  const at::Tensor root_mean_c = root_mean.contiguous();
  std::optional<at::Tensor> w_v_c, w_o_c;
  if (w_v.has_value()) {
    w_v_c = w_v->contiguous();
    w_o_c = w_o->contiguous();
  }
  AT_DISPATCH_FLOATING_TYPES(attn.scalar_type(), "path_chunk_norms", [&] {
    Backend backend(fused_leaves);
    for (int64_t b = 0; b < batch; ++b) {
      const Network net{attn_c[b], attn_mean_c[b], w_v_c, w_o_c};
      evaluate_chunk<scalar_t>(net, root_c[b], root_mean_c[b], chunk, leaf_block,
                               residual[b].mutable_data_ptr<scalar_t>(), norm[b].mutable_data_ptr<scalar_t>(), backend);
    }
  });
  return {residual, norm};
}

}  // namespace pathkernels::engine
