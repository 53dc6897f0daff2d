// CPU harness of the fused leaf kernel (fused_leaf.h): every CTA's steps run thread by thread, in
// the order the CUDA kernel's barriers impose, then the same finish step. It backs the CPU
// `_fused_leaf_norms` op, so that the CPU test suite checks the per-thread code the GPU runs. The
// CPU engine does not use it: there a leaf block is one GEMM reduced while still in cache
// (paths_cpu.cpp), which is the fast form of the same fusion on a CPU.
#include <torch/library.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "paths/paths.h"

namespace pathkernels {
namespace {

using namespace fused_leaf;

template <typename T, typename A, int kRows>
void run_cta(const Params& p, int64_t leaf, int64_t tile) {
  using Cta = Tile<T, A, kRows>;
  const auto shared = std::make_unique<typename Cta::Shared>();
  std::vector<typename Cta::Registers> registers(kThreads);
  for (int tid = 0; tid < kThreads; ++tid) {
    Cta::clear(registers[tid]);
    Cta::load_mean(p, *shared, tid, leaf, tile);
  }
  for (int64_t k0 = 0; k0 < p.n; k0 += kTileDepth) {
    for (int tid = 0; tid < kThreads; ++tid) {
      Cta::load(p, *shared, tid, leaf, tile, k0);
    }
    for (int tid = 0; tid < kThreads; ++tid) {
      Cta::multiply(*shared, registers[tid], tid);
    }
  }
  for (int tid = 0; tid < kThreads; ++tid) {
    Cta::partial_sums(p, *shared, registers[tid], tid, leaf, tile);
  }
  for (int tid = 0; tid < kThreads; ++tid) {
    Cta::write_sums(p, *shared, tid, leaf, tile);
  }
}

// Per leaf: row sums completed across tiles, then sqrt(max column sum · max row sum) per stat.
template <typename A>
void finish(const Params& p, double* residual, double* norm) {
  double* outputs[kStats] = {residual, norm};
  for (int64_t leaf = 0; leaf < p.count; ++leaf) {
    const A* cols = static_cast<const A*>(p.col_stats) + leaf * p.cols * kStats;
    A* rows = static_cast<A*>(p.row_stats) + leaf * p.tiles * p.n * kStats;
    for (int64_t e = 0; e < p.n * kStats; ++e) {
      fold_row_tiles(rows, p.tiles, p.n, e);
    }
    for (int stat = 0; stat < kStats; ++stat) {
      A l1 = A(0), linf = A(0);
      int64_t col = 0, row = 0;
      for (int64_t j = 0; j < p.cols; ++j) {
        max_update(cols[j * kStats + stat], j, l1, col);
      }
      for (int64_t i = 0; i < p.n; ++i) {
        max_update(rows[i * kStats + stat], i, linf, row);
      }
      outputs[stat][leaf] = leaf_report(composite_from_parts(l1, linf), stat, p.scales[leaf]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fused_leaf_norms_cpu(const at::Tensor& attn, const at::Tensor& right,
                                                        const at::Tensor& mean, const std::optional<at::Tensor>& scale) {
  const FusedLeafOperands ops = check_fused_leaf(attn, right, mean, scale);
  at::Tensor residual = at::empty({ops.right.size(1)}, ops.right.options().dtype(at::kDouble));
  at::Tensor norm = at::empty_like(residual);
  auto [col_stats, row_stats] = fused_leaf_buffers(ops);
  const Params p = fused_leaf_params(ops, col_stats, row_stats);
  AT_DISPATCH_FLOATING_TYPES(attn.scalar_type(), "_fused_leaf_norms", [&] {
    using A = norm_acc_t<scalar_t>;
    dispatch_tile_rows(p.n, [&](auto rows) {
      for (int64_t leaf = 0; leaf < p.count; ++leaf) {
        for (int64_t tile = 0; tile < p.tiles; ++tile) {
          run_cta<scalar_t, A, decltype(rows)::value>(p, leaf, tile);
        }
      }
    });
    finish<A>(p, residual.mutable_data_ptr<double>(), norm.mutable_data_ptr<double>());
  });
  return {residual, norm};
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("_fused_leaf_norms", &fused_leaf_norms_cpu);
}

}  // namespace pathkernels
