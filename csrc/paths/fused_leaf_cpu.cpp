// CPU harness of the fused leaf kernels (fused_leaf.h, tensor_leaf.h): every CTA's steps run
// thread by thread, in the order the CUDA kernel's barriers impose, then the same finish step.
// The tensor tile's one warp-collective step, the mma, is recorded lane by lane and replayed on
// the 32 lanes' fragments (emulate_mma). It backs the CPU `_fused_leaf_norms` op, so that the CPU
// test suite checks the per-thread code the GPU runs. The CPU engine does not use it: there a leaf
// block is one GEMM reduced while still in cache (paths_cpu.cpp), which is the fast form of the
// same fusion on a CPU.
#include <torch/library.h>

#include <array>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "paths/paths.h"
#include "paths/tensor_leaf.h"

namespace pathkernels {
namespace {

using namespace fused_leaf;

// One lane's side of one mma: its fragments, and its accumulator registers (in the lane's Registers).
struct RecordedMma {
  float* acc;
  MmaFragments fragments;
};
using WarpRecord = std::array<std::vector<RecordedMma>, kWarpSize>;

// Replays the warp's `index`-th mma: D = A B + C with A [16, 8] and B [8, 8] gathered from the
// lanes' fragments by MmaLayout, each product exact (TF32 operands) and each sum rounded once to
// float32: an ideal tensor core.
void emulate_mma(const WarpRecord& calls, size_t index) {
  float a[kMmaRows][kMmaDepth];
  float b[kMmaDepth][kMmaCols];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const MmaFragments& f = calls[lane][index].fragments;
    for (int e = 0; e < 4; ++e) {
      a[MmaLayout::a_row(lane, e)][MmaLayout::a_col(lane, e)] = bits_float(f.a[e]);
    }
    for (int e = 0; e < 2; ++e) {
      b[MmaLayout::b_row(lane, e)][MmaLayout::b_col(lane)] = bits_float(f.b[e]);
    }
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    float* acc = calls[lane][index].acc;
    for (int e = 0; e < 4; ++e) {
      const int row = MmaLayout::c_row(lane, e), col = MmaLayout::c_col(lane, e);
      double d = acc[e];
      for (int k = 0; k < kMmaDepth; ++k) {
        d += static_cast<double>(a[row][k]) * static_cast<double>(b[k][col]);
      }
      acc[e] = static_cast<float>(d);
    }
  }
}

// The multiply step of every thread of the CTA: per thread for the SIMT tile; per warp, recorded
// and replayed, for the tensor tile.
template <typename Cta>
void multiply_cta(const typename Cta::Shared& shared, std::vector<typename Cta::Registers>& registers) {
  if constexpr (!Cta::kTensorCores) {
    for (int tid = 0; tid < kThreads; ++tid) {
      Cta::multiply(shared, registers[tid], tid);
    }
  } else {
    for (int warp = 0; warp < kWarps; ++warp) {
      WarpRecord calls;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const int tid = warp * kWarpSize + lane;
        Cta::multiply(shared, registers[tid], tid, [&calls, lane](float(&acc)[4], const MmaFragments& f) {
          calls[lane].push_back({acc, f});
        });
      }
      for (int lane = 1; lane < kWarpSize; ++lane) {
        TORCH_INTERNAL_ASSERT(calls[lane].size() == calls[0].size(), "a warp's lanes issued different mmas");
      }
      for (size_t index = 0; index < calls[0].size(); ++index) {
        emulate_mma(calls, index);
      }
    }
  }
}

template <typename Cta>
void run_cta(const Params& p, int64_t leaf, int64_t tile) {
  const auto shared = std::make_unique<typename Cta::Shared>();
  std::vector<typename Cta::Registers> registers(kThreads);
  for (int tid = 0; tid < kThreads; ++tid) {
    Cta::clear(registers[tid]);
    load_mean<typename Cta::Element>(p, shared->mean, tid, leaf, tile);
  }
  for (int64_t k0 = 0; k0 < p.n; k0 += kTileDepth) {
    for (int tid = 0; tid < kThreads; ++tid) {
      Cta::load(p, *shared, tid, leaf, tile, k0);
    }
    multiply_cta<Cta>(*shared, registers);
  }
  for (int tid = 0; tid < kThreads; ++tid) {
    Cta::partial_sums(p, *shared, registers[tid], tid, leaf, tile);
  }
  for (int tid = 0; tid < kThreads; ++tid) {
    write_sums(p, shared->sums, tid, leaf, tile);
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
                                                        const at::Tensor& mean, const std::optional<at::Tensor>& scale,
                                                        c10::string_view kernel) {
  const FusedLeafOperands ops = check_fused_leaf(attn, right, mean, scale, kernel);
  at::Tensor residual = at::empty({ops.right.size(1)}, ops.right.options().dtype(at::kDouble));
  at::Tensor norm = at::empty_like(residual);
  auto [col_stats, row_stats] = fused_leaf_buffers(ops);
  const Params p = fused_leaf_params(ops, col_stats, row_stats);
  AT_DISPATCH_FLOATING_TYPES(attn.scalar_type(), "_fused_leaf_norms", [&] {
    using A = norm_acc_t<scalar_t>;
    dispatch_tile_rows(p.n, [&](auto rows) {
      constexpr int kRows = decltype(rows)::value;
      for (int64_t leaf = 0; leaf < p.count; ++leaf) {
        for (int64_t tile = 0; tile < p.tiles; ++tile) {
          if constexpr (std::is_same_v<scalar_t, float>) {
            switch (ops.kernel) {
              case LeafKernel::kTf32x3:
                run_cta<TensorTile<kRows, 3>>(p, leaf, tile);
                continue;
              case LeafKernel::kTf32:
                run_cta<TensorTile<kRows, 1>>(p, leaf, tile);
                continue;
              case LeafKernel::kSimt:
                break;
            }
          }
          run_cta<Tile<scalar_t, A, kRows>>(p, leaf, tile);
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
