// The path-tree engine, device-generic: one call evaluates one chunk of a path tree, breadth-
// first. Every level is a handful of large GEMMs (one per block of nodes sharing a head: cuBLAS on
// CUDA, on CPU the engine's own kernel of gemm_cpu.h, whose elements do not depend on how the
// nodes are blocked), and the leaves are reduced to their norms block by block by the backend
// (paths_cpu.cpp, paths_cuda.cu); no leaf matrix outlives its block.
//
// What travels down the tree (docs/DESIGN.md §1): the residual R = C(P) (or C(P X W)), never the product,
// so tiny residuals keep their relative precision; R_child = C(A) R_parent (W), with C(A) given.
// The column mean μ of the full product follows μ_child = (μ_parent + R_parentᵀ a) W, a = 1ᵀA/n,
// and the product itself is 1μᵀ + R.
//
// float32 range (docs/DESIGN.md §3, Precision): R shrinks with every head a path takes and would fall below
// float32's smallest normal (1.2e-38) in deep trees. Each node therefore stores R' = R / s with a
// power-of-two scale s in float64: a child whose largest |R'| leaves [2^-32, 2^32] is renormalised
// (exactly: a power of two), and its scale takes the factor. The leaves report ‖R‖ = s‖R'‖ and
// ‖1μᵀ + s R'‖ in float64, so float32 trees keep their relative precision down to float64's range.
// μ needs no scale: it is the column mean of the product, not of the residual. float64 trees keep
// s = 1 (their range is the reports' own).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paths/heads_leaf_op.h"
#include "paths/paths.h"
#include "paths/scales.h"

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

// Nodes of a level (or of a block of it): residuals R' [n, N, m] (R = s R'), column means
// μ [N, m] and scales s [N] in float64.
struct Nodes {
  at::Tensor residual;
  at::Tensor mean;
  at::Tensor scale;

  Nodes narrow(int64_t begin, int64_t count) const {
    return {residual.narrow(1, begin, count), mean.narrow(0, begin, count), scale.narrow(0, begin, count)};
  }
  Nodes index_select(const at::Tensor& index) const {
    return {residual.index_select(1, index), mean.index_select(0, index), scale.index_select(0, index)};
  }
  int64_t count() const {
    return residual.size(1);
  }
};

// The parents of a block: a view of the level when their positions are consecutive (always so in
// complete trees), otherwise a gathered copy. `positions` is the level's on the host (for the scan),
// copied to the level's device only for a gather.
inline Nodes run_parents(const Nodes& level, const at::Tensor& positions, int64_t begin, int64_t count) {
  const int64_t* p = positions.const_data_ptr<int64_t>() + begin;
  bool consecutive = true;
  for (int64_t k = 1; k < count && consecutive; ++k) {
    consecutive = p[k] == p[0] + k;
  }
  if (consecutive) {
    return level.narrow(p[0], count);
  }
  return level.index_select(positions.narrow(0, begin, count).to(level.residual.device()));
}

// The operands of one batch element.
struct Network {
  at::Tensor attn;       // [L, H, n, n], centred: C(A) = A − 1aᵀ
  at::Tensor attn_mean;  // [L, H, n], a = 1ᵀA/n
  std::optional<at::Tensor> w_v;  // [L, H, d, d_head]
  std::optional<at::Tensor> w_o;  // [L, H, d_head, d]
  bool renormalises;              // float32: nodes carry scales (see the top of this file)
};

// What a child block multiplies C(A[layer, head]) by, and its column means: with W, right =
// R'_parent W and μ = (μ_parent + s R'_parentᵀ a) W; without, right = R'_parent (a view) and
// μ = μ_parent + s R'_parentᵀ a. `right` is [n, c, m] with unit column stride and leaf stride m;
// the children's residuals are C(A) right, with the parents' scales.
struct ChildOperands {
  at::Tensor right;
  at::Tensor mean;
  at::Tensor scale;
};

// a @ b in a new tensor, by the backend's products (Backend::matmul).
template <typename Backend>
at::Tensor product(Backend& backend, const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  backend.matmul(out, a, b, false);
  return out;
}

template <typename T, typename Backend>
ChildOperands child_operands(Backend& backend, const Network& net, int64_t layer, int64_t head, const Nodes& parents) {
  const int64_t n = parents.residual.size(0), c = parents.count(), m = parents.residual.size(2);
  const at::Tensor a = net.attn_mean[layer][head].unsqueeze(0);
  at::Tensor mean;
  if (net.renormalises) {
    // s R'ᵀ a per node: the GEMV on R', then each node's scale.
    mean = backend.template add_scaled<T>(parents.mean, product(backend, a, parents.residual.flatten(1)).view({c, m}),
                                          parents.scale);
  } else {
    // s = 1: one GEMM that adds to a copy of μ_parent (one launch on CUDA), all c at once.
    mean = parents.mean.reshape({1, c * m}).clone();
    backend.matmul(mean, a, parents.residual.flatten(1), true);
    mean = mean.view({c, m});
  }
  if (!net.w_v.has_value()) {
    return {parents.residual, mean, parents.scale};
  }
  const at::Tensor w_v = (*net.w_v)[layer][head];
  const at::Tensor w_o = (*net.w_o)[layer][head];
  const at::Tensor right = product(backend, product(backend, parents.residual.reshape({n * c, m}), w_v), w_o);
  return {right.view({n, c, m}), product(backend, product(backend, mean, w_v), w_o), parents.scale};
}

// Children of `parents` through head `head` of layer `layer`, written to `out` (views of the next
// level), renormalised where the tree carries scales. The skip branch copies.
template <typename T, typename Backend>
void children(Backend& backend, const Network& net, int64_t layer, int64_t head, const Nodes& parents,
              const Nodes& out) {
  if (head < 0) {
    out.residual.copy_(parents.residual);
    out.mean.copy_(parents.mean);
    backend.template carry_scales<T>(out, parents.scale, false);
    return;
  }
  const ChildOperands operands = child_operands<T>(backend, net, layer, head, parents);
  at::Tensor out_rows = out.residual.flatten(1);  // [n, c·m] with the level's row stride: a view, no copy
  TORCH_INTERNAL_ASSERT(out_rows.is_alias_of(out.residual));
  backend.matmul(out_rows, net.attn[layer][head], operands.right.flatten(1), false);
  out.mean.copy_(operands.mean);
  backend.template carry_scales<T>(out, operands.scale, net.renormalises);
}

// Leaf children of `parents` through head `head` into `out` (a scratch block: R' and μ; the
// scales are the parents', used where they lie), returned with those scales for the reduction.
template <typename T, typename Backend>
Nodes leaf_children(Backend& backend, const Network& net, int64_t layer, int64_t head, const Nodes& parents,
                    const Nodes& out) {
  const ChildOperands operands = child_operands<T>(backend, net, layer, head, parents);
  at::Tensor out_rows = out.residual.flatten(1);
  TORCH_INTERNAL_ASSERT(out_rows.is_alias_of(out.residual));
  backend.matmul(out_rows, net.attn[layer][head], operands.right.flatten(1), false);
  out.mean.copy_(operands.mean);
  return {out.residual, out.mean, operands.scale};
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
bool fused_leaf_norms(Backend& backend, const Network& net, int64_t layer, int64_t head, const Nodes& parents,
                      double* residual, double* norm) {
  if constexpr (Backend::kFusedLeaves) {
    if (backend.fuses_leaves(parents.residual.size(0))) {
      backend.template fused_leaf_norms<T>(net.attn[layer][head],
                                           child_operands<T>(backend, net, layer, head, parents), residual, norm);
      return true;
    }
  }
  return false;
}

// Where every head of a layer takes the same parents at a level, in head order (every level of a
// complete tree, with or without the skip, and pruned by length): the first node of head 0's run,
// the run's length (the runs of heads 1.. follow it) and those parents; nullopt otherwise. The skip
// run, which comes first where there is one, is left to the caller.
struct SharedParents {
  int64_t begin;
  int64_t count;
  Nodes parents;
};

inline std::optional<SharedParents> shared_parents(const Nodes& level, int64_t num_heads, const at::Tensor& positions,
                                                   const at::Tensor& heads) {
  std::vector<HeadRun> runs = head_runs(heads);
  if (!runs.empty() && runs.front().head < 0) {
    runs.erase(runs.begin());
  }
  if (static_cast<int64_t>(runs.size()) != num_heads) {
    return std::nullopt;
  }
  const int64_t count = runs.front().end - runs.front().begin;
  const int64_t* p = positions.const_data_ptr<int64_t>();
  for (int64_t h = 0; h < num_heads; ++h) {
    const HeadRun& run = runs[h];
    if (run.head != h || run.end - run.begin != count || !std::equal(p + run.begin, p + run.end, p + runs[0].begin)) {
      return std::nullopt;
    }
  }
  return SharedParents{runs.front().begin, count, run_parents(level, positions, runs.front().begin, count)};
}

// The leaves of a level at which every head of the layer takes the same parents (the leaf level of
// a complete tree, and of any tree whose last layer branches fully): all H heads' leaves in one call
// of the backend's heads leaf kernel (heads_leaf.h), which reads each parent once for every head and
// takes the children's column means from the centring identity. Returns false, having done nothing,
// where the level is not so, or W is factored (each head's right operand R' W_h differs), or n is
// beyond the kernel; the caller then takes the level's blocks head by head.
template <typename Backend>
bool every_head_leaves(Backend& backend, const Network& net, int64_t layer, const EngineHeadsKernel& kernel,
                       const Nodes& level, const at::Tensor& positions, const at::Tensor& heads, double* residual,
                       double* norm) {
  const int64_t num_heads = net.attn.size(1);
  if (net.w_v.has_value() || level.residual.size(0) > heads_leaf::kMaxRows) {
    return false;
  }
  const auto shared = shared_parents(level, num_heads, positions, heads);
  if (!shared.has_value()) {
    return false;
  }
  const auto& [begin, count, parents] = *shared;
  const HeadsLeafOperands ops{
      net.attn[layer], net.attn_mean[layer], parents.residual, parents.mean, parents.scale, kernel.variant,
      kernel.triton_precision};
  const auto [head_residual, head_norm] =  // [count, H]
      kernel.triton_precision != nullptr ? triton_leaf_norms(ops, "pathkernels.path_chunk_norms")
                                         : backend.heads_leaf_norms(ops);
  // The runs tile the level in head order, so leaf (parent k, head h) is begin + h·count + k.
  const auto doubles = head_residual.options();
  at::from_blob(residual + begin, {num_heads, count}, doubles).copy_(head_residual.t());
  at::from_blob(norm + begin, {num_heads, count}, doubles).copy_(head_norm.t());
  return true;
}

// The leaves of a level at which every head of the layer takes the same parents, on a backend that
// takes them block of parents by block of parents (Backend::shared_parent_leaves, the CPU's): each
// parent block is read once for all H heads, which keeps it in cache, and the children's column
// means of every head come from one product of the layer's a [H, n] with it (the centring
// identity). The same arithmetic as the blocks head by head, so the same bits. False, having done
// nothing, where the level is not so or W is factored.
template <typename T, typename Backend>
bool every_head_leaf_blocks(Backend& backend, const Network& net, int64_t layer, const Nodes& level,
                            const at::Tensor& positions, const at::Tensor& heads, int64_t leaf_block, double* residual,
                            double* norm) {
  if (net.w_v.has_value()) {
    return false;
  }
  const auto shared = shared_parents(level, net.attn.size(1), positions, heads);
  if (!shared.has_value()) {
    return false;
  }
  // Leaf (parent k, head h) is begin + h·count + k: the runs tile the level in head order.
  backend.template shared_parent_leaves<T>(net.attn[layer], net.attn_mean[layer], shared->parents, leaf_block,
                                           net.renormalises, residual + shared->begin, norm + shared->begin);
  return true;
}

// The children through every head of an internal level whose heads share their parents
// (shared_parents), in a fixed number of launches whatever H: the residuals C(A_h) R' of every
// head in one batched product (Backend::head_products) written into the level's head runs, the
// column means μ + s R'ᵀ a_h of every head from one GEMM of the layer's a [H, n], and the scales of
// every child in one pass. The same arithmetic as children() head by head (on the CPU the same bits:
// its products do not depend on how the nodes are grouped). False, having done nothing, where the
// level is not so or W is factored; the caller then takes the level head run by head run.
template <typename T, typename Backend>
bool every_head_children(Backend& backend, const Network& net, int64_t layer, const Nodes& level,
                         const at::Tensor& positions, const at::Tensor& heads, const Nodes& next) {
  const int64_t num_heads = net.attn.size(1);
  if (net.w_v.has_value()) {
    return false;
  }
  const auto shared = shared_parents(level, num_heads, positions, heads);
  if (!shared.has_value()) {
    return false;
  }
  const auto& [begin, count, parents] = *shared;
  const int64_t n = parents.residual.size(0), m = parents.residual.size(2);
  const Nodes out = next.narrow(begin, num_heads * count);  // head h's children: count nodes from h·count
  const at::Tensor right = parents.residual.flatten(1);     // [n, c·m], the level's row stride
  // [H, n, c·m] views of the level: head h's rows are its run's [n, c·m] block.
  backend.head_products(out.residual.view({n, num_heads, count * m}).transpose(0, 1), net.attn[layer], right);
  const at::Tensor means = out.mean.view({num_heads, count * m});
  if (net.renormalises) {
    const at::Tensor shifts = product(backend, net.attn_mean[layer], right);  // [H, c·m]: R'ᵀ a_h
    means.view({num_heads * count, m})
        .copy_(backend.template add_scaled<T>(parents.mean.repeat({num_heads, 1}),
                                              shifts.view({num_heads * count, m}), parents.scale.repeat({num_heads})));
  } else {
    out.mean.view({num_heads, count, m}).copy_(parents.mean.unsqueeze(0).expand({num_heads, count, m}));
    backend.matmul(means, net.attn_mean[layer], right, true);
  }
  backend.template carry_scales<T>(out, parents.scale.repeat({num_heads}), net.renormalises);
  return true;
}

// One chunk for one batch element, into residual and norm (float64, one per leaf). Backend provides
//   matmul(out, a, b, accumulate): out = a @ b, or out += a @ b, for 2-D operands with unit column
//   strides (out a view into a level, never overlapping a or b),
//   for_each_block(count, fn): calls fn(block, worker) for every block (in parallel or not),
//   workers(): how many distinct `worker` values fn may see,
//   reduce<T>(leaves, residual, norm): the norms of the leaves (Nodes: R' [n, c, m], μ, s) into c
//   outputs each,
//   add_scaled<T>(mean, shift, scale): mean + scale · shift per node ([c, m], scale [c] float64; a
//   scale below T's range makes its term 0, negligible against μ, the product's own mean),
//   carry_scales<T>(out, parent_scale, renormalise): out.scale = parent_scale, then, with
//   `renormalise`, the rule of scales.h applied to each node of out, in place,
//   heads_leaf_norms(ops): the heads leaf kernel (heads_leaf_op.h) on laid-out operands,
//   head_products(out [H, n, c·m], attn [H, n, n], right [n, c·m]): out[h] = attn[h] @ right for
//   every head (out a view into a level, rows of unit column stride),
// and, where kFusedLeaves, fuses_leaves(n) and fused_leaf_norms<T>(attn [n, n], operands, residual,
// norm): the norms of the leaves C(A) · operands.right, computed without storing them; where
// kSharedParentLeaves and shared_parent_leaves_enabled(), shared_parent_leaves<T>(attn [H, n, n],
// attn_mean [H, n], parents, leaf_block, renormalises, residual, norm): the leaves of every head of
// parents that all heads share (every_head_leaf_blocks), leaf (k, h) at h·count + k.
// `every_head`: the heads leaf kernel (its variant, or the Triton kernel's precision) for leaf levels
// it can take whole (every_head_leaves; float32 only), or none. `all_heads_levels`: internal levels
// whose heads share their parents go through every_head_children, otherwise head run by head run.
template <typename T, typename Backend>
void evaluate_chunk(const Network& net, const at::Tensor& root, const at::Tensor& root_mean, const PathChunk& chunk,
                    int64_t leaf_block, const std::optional<EngineHeadsKernel>& every_head, bool all_heads_levels,
                    double* residual, double* norm, Backend& backend) {
  const int64_t layers = static_cast<int64_t>(chunk.parents.size());
  const int64_t n = root.size(0), m = root.size(1);
  const auto scale_options = root.options().dtype(at::kDouble);
  Nodes level{root.unsqueeze(1), root_mean.unsqueeze(0), at::ones({1}, scale_options)};
  // Per-worker leaf blocks: computed, reduced, overwritten; never a whole level of leaves.
  std::vector<Nodes> scratch(backend.workers());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor& positions = chunk.parents[l];
    const bool leaves = l + 1 == layers;
    Nodes next;
    if (!leaves) {
      next = {at::empty({n, positions.numel(), m}, root.options()), at::empty({positions.numel(), m}, root.options()),
              at::empty({positions.numel()}, scale_options)};
    }
    std::vector<NodeBlock> blocks = node_blocks(chunk.heads[l], leaf_block);
    if (!leaves && all_heads_levels &&
        every_head_children<T>(backend, net, l, level, positions, chunk.heads[l], next)) {
      std::erase_if(blocks, [](const NodeBlock& blk) { return blk.head >= 0; });  // done: the skip children remain
    }
    if constexpr (std::is_same_v<T, float>) {
      if (leaves && every_head.has_value() &&
          every_head_leaves(backend, net, l, *every_head, level, positions, chunk.heads[l], residual, norm)) {
        std::erase_if(blocks, [](const NodeBlock& blk) { return blk.head >= 0; });  // done: the skip leaves remain
      }
    }
    if constexpr (Backend::kSharedParentLeaves) {
      if (leaves && !every_head.has_value() && backend.shared_parent_leaves_enabled() &&
          every_head_leaf_blocks<T>(backend, net, l, level, positions, chunk.heads[l], leaf_block, residual, norm)) {
        std::erase_if(blocks, [](const NodeBlock& blk) { return blk.head >= 0; });  // done: the skip leaves remain
      }
    }
    backend.for_each_block(static_cast<int64_t>(blocks.size()), [&](int64_t k, int worker) {
      const NodeBlock& blk = blocks[k];
      const Nodes parents = run_parents(level, positions, blk.begin, blk.count);
      if (!leaves) {
        children<T>(backend, net, l, blk.head, parents, next.narrow(blk.begin, blk.count));
      } else if (blk.head < 0) {  // a skip leaf is its parent: reduce it where it lies
        backend.template reduce<T>(parents, residual + blk.begin, norm + blk.begin);
      } else if (!fused_leaf_norms<T>(backend, net, l, blk.head, parents, residual + blk.begin, norm + blk.begin)) {
        if (!scratch[worker].residual.defined()) {
          scratch[worker] = {at::empty({n, leaf_block, m}, root.options()), at::empty({leaf_block, m}, root.options()),
                             at::Tensor()};
        }
        const Nodes out = {scratch[worker].residual.narrow(1, 0, blk.count),
                           scratch[worker].mean.narrow(0, 0, blk.count), at::Tensor()};
        backend.template reduce<T>(leaf_children<T>(backend, net, l, blk.head, parents, out), residual + blk.begin,
                                   norm + blk.begin);
      }
    });
    if (!leaves) {
      level = next;
    }
  }
}

// The whole op for one backend: checks, outputs on attn's device, one chunk per batch element.
template <typename Backend>
std::tuple<at::Tensor, at::Tensor> path_chunk_norms(const at::Tensor& attn, const at::Tensor& attn_mean,
                                                    const at::Tensor& root, const at::Tensor& root_mean,
                                                    const std::optional<at::Tensor>& w_v,
                                                    const std::optional<at::Tensor>& w_o, at::TensorList parents,
                                                    at::TensorList heads, int64_t leaf_block,
                                                    c10::string_view leaf_kernel, bool all_heads_levels) {
  constexpr const char* op = "pathkernels.path_chunk_norms";
  const PathChunk chunk = check_path_chunk(attn, attn_mean, root, root_mean, w_v, w_o, parents, heads, leaf_block);
  const std::optional<EngineHeadsKernel> every_head = engine_heads_kernel(leaf_kernel, attn.scalar_type(), op);
  const LeafKernel kernel = parse_leaf_kernel(every_head ? every_head->per_head : leaf_kernel, attn.scalar_type(),
                                              true, op, "leaf_kernel");
  const int64_t batch = attn.size(0);
  const int64_t leaves = chunk.parents.back().numel();
  // No level of a trie has more nodes than its leaves, so larger blocks change nothing; capping
  // keeps the scratch blocks' sizes and the block loop's arithmetic within range.
  const int64_t block = std::max<int64_t>(1, std::min(leaf_block, leaves));
  // float64 reports for every dtype: a float32 tree's residuals may lie below float32's range.
  at::Tensor residual = at::empty({batch, leaves}, attn.options().dtype(at::kDouble));
  at::Tensor norm = at::empty({batch, leaves}, attn.options().dtype(at::kDouble));
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
    Backend backend(kernel);
    for (int64_t b = 0; b < batch; ++b) {
      const Network net{attn_c[b], attn_mean_c[b], w_v_c, w_o_c, std::is_same_v<scalar_t, float>};
      evaluate_chunk<scalar_t>(net, root_c[b], root_mean_c[b], chunk, block, every_head, all_heads_levels,
                               residual[b].mutable_data_ptr<double>(), norm[b].mutable_data_ptr<double>(), backend);
    }
  });
  return {residual, norm};
}

}  // namespace pathkernels::engine
