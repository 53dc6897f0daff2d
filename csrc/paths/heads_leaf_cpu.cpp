// `_heads_leaf_norms`: the shared input checks, and the CPU harness of the heads leaf kernel
// (heads_leaf.h), which backs the op on the CPU so that the CPU tests check the code every GPU thread
// runs. A test harness, not a fast path: the CPU engine reduces its leaves in cache (paths_cpu.cpp).
//
// The harness runs heads_leaf::run_cta for every CTA, one after another (column tiles in reverse, so
// that the first tile's CTA is the one that finishes a parent), through HostCta, an executor that
//   - queues each thread's steps and runs them at the next barrier or warp collective, thread after
//     thread: a segment that read data another thread writes in it without a barrier would read the
//     other thread's old or poisoned values;
//   - starts shared memory and registers as NaN, as the GPU's garbage might be;
//   - emulates cp.async (HostCopier): a copy checks its alignment and source bounds and poisons its
//     destination with NaN at issue; the data lands at wait_all;
//   - runs the shuffles' rounds in lockstep over the 32 lanes (keep + received, as the device adds);
//   - records each lane's mma and replays the warp's calls at the next barrier as exact products of
//     the 32 lanes' fragments gathered by MmaLayout (an ideal tensor core).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "paths/heads_leaf_op.h"

namespace pathkernels {

const char* variant_name(heads_leaf::Variant variant) {
  switch (variant) {
    case heads_leaf::Variant::kTf32x3:
      return "tf32x3";
    case heads_leaf::Variant::kTf32x3Wide:
      return "tf32x3_128";
    case heads_leaf::Variant::kTf32:
      return "tf32";
    case heads_leaf::Variant::kTf32Wide:
      return "tf32_128";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown heads leaf variant");
}

namespace {

constexpr const char* kOp = "pathkernels._heads_leaf_norms";

constexpr heads_leaf::Variant kVariants[] = {heads_leaf::Variant::kTf32x3, heads_leaf::Variant::kTf32x3Wide,
                                             heads_leaf::Variant::kTf32, heads_leaf::Variant::kTf32Wide};

// The variant called `name`, if any.
std::optional<heads_leaf::Variant> find_variant(c10::string_view name) {
  for (const heads_leaf::Variant variant : kVariants) {
    if (name == variant_name(variant)) {
      return variant;
    }
  }
  return std::nullopt;
}

heads_leaf::Variant parse_variant(c10::string_view name) {
  const std::optional<heads_leaf::Variant> variant = find_variant(name);
  TORCH_CHECK_VALUE(variant.has_value(), kOp, ": expected kernel in ('tf32x3', 'tf32x3_128', 'tf32', 'tf32_128'), got '",
                    std::string(name), "'");
  return *variant;
}

bool aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

}  // namespace

std::optional<EngineHeadsKernel> engine_heads_kernel(c10::string_view leaf_kernel, at::ScalarType dtype,
                                                     const char* op) {
  using heads_leaf::Variant;
  constexpr c10::string_view kPrefix = "heads_";
  std::optional<EngineHeadsKernel> kernel;
  if (leaf_kernel == "triton_tf32x3") {
    kernel = EngineHeadsKernel{Variant::kTf32x3, "tf32x3", "tf32x3"};
  } else if (leaf_kernel == "triton_tf32") {
    kernel = EngineHeadsKernel{Variant::kTf32, "tf32", "tf32"};
  } else if (leaf_kernel.substr(0, kPrefix.size()) == kPrefix) {
    const std::optional<Variant> variant = find_variant(leaf_kernel.substr(kPrefix.size()));
    TORCH_CHECK_VALUE(variant.has_value(), op,
                      ": expected leaf_kernel 'heads_' followed by 'tf32x3', 'tf32x3_128', 'tf32' or 'tf32_128', got '",
                      std::string(leaf_kernel), "'");
    const bool three_passes = *variant == Variant::kTf32x3 || *variant == Variant::kTf32x3Wide;
    kernel = EngineHeadsKernel{*variant, three_passes ? "tf32x3" : "tf32"};
  } else {
    return std::nullopt;
  }
  TORCH_CHECK_TYPE(dtype == at::kFloat, op, ": leaf_kernel='", std::string(leaf_kernel),
                   "' runs on TF32 tensor cores and takes torch.float32, got ", dtype_name(dtype));
  return kernel;
}

std::tuple<at::Tensor, at::Tensor> triton_leaf_norms(const HeadsLeafOperands& ops, const char* op) {
  const auto handle = c10::Dispatcher::singleton().findSchema({"pathkernels::triton_leaf_norms", ""});
  TORCH_CHECK(handle.has_value(), op, ": leaf_kernel 'triton_", ops.triton_precision,
              "' calls the Triton op pathkernels::triton_leaf_norms, which is not registered (Python registers it: ",
              "pathkernels.core.triton_leaf.op(), with Triton installed)");
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const std::optional<at::Tensor>&,
                                                        c10::string_view);
  return handle->typed<Signature>().call(ops.attn, ops.attn_mean, ops.right, ops.mean, ops.scale,
                                         ops.triton_precision);
}

HeadsLeafOperands check_heads_leaf(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& right,
                                   const at::Tensor& mean, const std::optional<at::Tensor>& scale,
                                   c10::string_view kernel) {
  TORCH_CHECK_VALUE(attn.dim() == 3 && attn.size(1) == attn.size(2), kOp, ": expected attn [H, n, n], got shape ",
                    shape_string(attn.sizes()));
  const int64_t heads = attn.size(0), n = attn.size(1);
  TORCH_CHECK_VALUE(n >= 1 && n <= heads_leaf::kMaxRows, kOp, ": expected 1 <= n <= ",
                    std::to_string(heads_leaf::kMaxRows), " rows, got n = ", std::to_string(n));
  TORCH_CHECK_VALUE(heads <= heads_leaf::kMaxHeads, kOp, ": expected at most ", std::to_string(heads_leaf::kMaxHeads),
                    " heads, got H = ", std::to_string(heads));
  TORCH_CHECK_TYPE(attn.scalar_type() == at::kFloat, kOp,
                   ": expected attn in torch.float32 (the kernels run on TF32 tensor cores), got ",
                   dtype_name(attn.scalar_type()));
  const std::vector<int64_t> attn_mean_shape{heads, n};
  TORCH_CHECK_VALUE(attn_mean.sizes() == at::IntArrayRef(attn_mean_shape), kOp, ": expected attn_mean [H, n] = ",
                    shape_string(attn_mean_shape), ", got ", shape_string(attn_mean.sizes()));
  TORCH_CHECK_VALUE(right.dim() == 3 && right.size(0) == n && right.size(2) >= 1, kOp,
                    ": expected right [n, c, m] with n = ", std::to_string(n), " and m >= 1, got shape ",
                    shape_string(right.sizes()));
  const int64_t count = right.size(1), m = right.size(2);
  const std::vector<int64_t> mean_shape{count, m};
  TORCH_CHECK_VALUE(mean.sizes() == at::IntArrayRef(mean_shape), kOp, ": expected mean [c, m] = ",
                    shape_string(mean_shape), ", got ", shape_string(mean.sizes()));
  for (const at::Tensor* t : {&attn_mean, &right, &mean}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, kOp, ": expected attn_mean, right and mean in torch.float32, got ",
                     dtype_name(t->scalar_type()));
    check_same_device(*t, attn, kOp, "attn_mean, right and mean", "attn");
  }
  const heads_leaf::Variant variant = parse_variant(kernel);
  at::Tensor parent_scale;
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->dim() == 1 && scale->size(0) == count, kOp, ": expected scale [c] = [",
                      std::to_string(count), "], got ", shape_string(scale->sizes()));
    TORCH_CHECK_TYPE(scale->scalar_type() == at::kDouble, kOp, ": expected scale in torch.float64, got ",
                     dtype_name(scale->scalar_type()));
    check_same_device(*scale, attn, kOp, "scale", "attn");
    parent_scale = scale->contiguous();
    // A scale multiplies the norms: one that is not a positive finite number would give a negative,
    // infinite or NaN norm.
    TORCH_CHECK_VALUE(count == 0 || (parent_scale.isfinite() & (parent_scale > 0)).all().item<bool>(), kOp,
                      ": expected every scale to be a positive finite number");
  } else {
    parent_scale = at::ones({count}, right.options().dtype(at::kDouble));
  }
  // The kernel reads element (i, k, j) of right at i·stride(0) + k·m + j; a stride of a dimension of
  // size 1 is never used (and may be anything, even in a contiguous tensor).
  const bool right_ok = (m <= 1 || right.stride(2) == 1) && (count <= 1 || right.stride(1) == m);
  const bool mean_ok = m <= 1 || mean.stride(1) == 1;
  return {attn.contiguous(),
          attn_mean.contiguous(),
          right_ok ? right : right.contiguous(),
          mean_ok ? mean : mean.contiguous(),
          parent_scale,
          variant};
}

int64_t heads_leaf_tiles(heads_leaf::Variant variant, int64_t m) {
  int64_t tiles = 0;
  heads_leaf::dispatch_cta(variant, 1, [&](auto cta) {
    using Cta = typename decltype(cta)::type;
    tiles = (m + Cta::kCols - 1) / Cta::kCols;
  });
  return tiles;
}

HeadsLeafBuffers heads_leaf_buffers(const HeadsLeafOperands& ops) {
  const int64_t heads = ops.attn.size(0), n = ops.attn.size(1), count = ops.right.size(1);
  const int64_t tiles = heads_leaf_tiles(ops.variant, ops.right.size(2));
  const auto doubles = ops.right.options().dtype(at::kDouble);
  HeadsLeafBuffers buffers;
  buffers.residual = at::empty({count, heads}, doubles);
  buffers.norm = at::empty({count, heads}, doubles);
  if (tiles > 1 && count > 0 && heads > 0) {
    const auto floats = ops.right.options().dtype(at::kFloat);
    buffers.col_shares = at::empty({count, heads, heads_leaf::kStats, tiles}, floats);
    buffers.row_shares = at::empty({count, heads, heads_leaf::kStats, tiles, n}, floats);
    buffers.arrivals = at::zeros({count}, ops.right.options().dtype(at::kInt));
  }
  return buffers;
}

heads_leaf::Params heads_leaf_params(const HeadsLeafOperands& ops, HeadsLeafBuffers& buffers,
                                     int64_t parents_per_block) {
  TORCH_INTERNAL_ASSERT(ops.attn.is_contiguous() && ops.attn_mean.is_contiguous() && ops.scale.is_contiguous());
  heads_leaf::Params p;
  p.attn = ops.attn.const_data_ptr<float>();
  p.attn_mean = ops.attn_mean.const_data_ptr<float>();
  p.heads = ops.attn.size(0);
  p.n = ops.attn.size(1);
  p.right = ops.right.const_data_ptr<float>();
  p.row_stride = ops.right.stride(0);
  p.count = ops.right.size(1);
  p.cols = ops.right.size(2);
  p.means = ops.mean.const_data_ptr<float>();
  p.mean_stride = ops.mean.stride(0);
  p.scales = ops.scale.const_data_ptr<double>();
  p.residual = buffers.residual.mutable_data_ptr<double>();
  p.norm = buffers.norm.mutable_data_ptr<double>();
  p.tiles = heads_leaf_tiles(ops.variant, p.cols);
  p.parents_per_block = parents_per_block;
  p.attn_vectors = p.n % 4 == 0 && aligned16(p.attn) && aligned16(p.attn_mean);
  p.right_vectors = p.cols % 4 == 0 && (p.n == 1 || p.row_stride % 4 == 0) && aligned16(p.right);
  if (buffers.arrivals.defined()) {
    p.col_shares = buffers.col_shares.mutable_data_ptr<float>();
    p.row_shares = buffers.row_shares.mutable_data_ptr<float>();
    p.arrivals = buffers.arrivals.mutable_data_ptr<int>();
  }
  return p;
}

namespace {

using heads_leaf::kWarpSize;
using heads_leaf::MmaFragments;
using heads_leaf::MmaLayout;

// The memory a harness copy may read: [begin, end) of each input.
struct Extent {
  const float* begin;
  const float* end;
};

// cp.async, as the harness models it: a copy checks what the GPU requires (alignment to its size, a
// source inside an input) and poisons its destination; its data lands when the thread waits.
class HostCopier {
 public:
  explicit HostCopier(const std::vector<Extent>* extents) : extents_(extents) {}

  void copy16(float* dst, const float* src, bool inside) {
    TORCH_INTERNAL_ASSERT(aligned16(dst) && aligned16(src), "heads leaf harness: a 16-byte cp.async is misaligned");
    issue(dst, src, 4, inside);
  }
  void copy4(float* dst, const float* src, bool inside) {
    issue(dst, src, 1, inside);
  }
  void commit() {}
  void wait_all() {
    for (const Copy& copy : pending_) {
      for (int i = 0; i < copy.floats; ++i) {
        copy.dst[i] = copy.inside ? copy.src[i] : 0.0f;
      }
    }
    pending_.clear();
  }
  bool idle() const {
    return pending_.empty();
  }

 private:
  struct Copy {
    float* dst;
    const float* src;
    int floats;
    bool inside;
  };

  void issue(float* dst, const float* src, int floats, bool inside) {
    bool readable = false;
    for (const Extent& extent : *extents_) {
      readable = readable || (src >= extent.begin && src + floats <= extent.end);
    }
    TORCH_INTERNAL_ASSERT(readable, "heads leaf harness: a cp.async reads outside the inputs");
    for (int i = 0; i < floats; ++i) {
      dst[i] = std::numeric_limits<float>::quiet_NaN();
    }
    pending_.push_back({dst, src, floats, inside});
  }

  const std::vector<Extent>* extents_;
  std::vector<Copy> pending_;
};

struct RecordedMma {
  float* acc;
  MmaFragments fragments;
};
using WarpRecord = std::array<std::vector<RecordedMma>, kWarpSize>;

// The warp's `index`-th mma: D = A B + C from the lanes' fragments (placed by MmaLayout), each
// product exact (TF32 operands) and each sum rounded once to float32.
void replay_mma(const WarpRecord& calls, size_t index) {
  float a[heads_leaf::kMmaRows][heads_leaf::kMmaDepth];
  float b[heads_leaf::kMmaDepth][heads_leaf::kMmaCols];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const MmaFragments& f = calls[lane][index].fragments;
    for (int e = 0; e < 4; ++e) {
      a[MmaLayout::a_row(lane, e)][MmaLayout::a_col(lane, e)] = heads_leaf::bits_float(f.a[e]);
    }
    for (int e = 0; e < 2; ++e) {
      b[MmaLayout::b_row(lane, e)][MmaLayout::b_col(lane)] = heads_leaf::bits_float(f.b[e]);
    }
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    float* acc = calls[lane][index].acc;
    for (int e = 0; e < 4; ++e) {
      const int row = MmaLayout::c_row(lane, e), col = MmaLayout::c_col(lane, e);
      double d = acc[e];
      for (int k = 0; k < heads_leaf::kMmaDepth; ++k) {
        d += static_cast<double>(a[row][k]) * static_cast<double>(b[k][col]);
      }
      acc[e] = static_cast<float>(d);
    }
  }
}

// The executor of heads_leaf::run_cta for one CTA on the CPU (see the top of this file).
template <typename Cta>
class HostCta {
 public:
  using Registers = typename Cta::Registers;

  struct Recorder {
    std::vector<RecordedMma>* calls;
    void operator()(float (&acc)[4], const MmaFragments& fragments) const {
      calls->push_back({acc, fragments});
    }
  };

  struct Thread {
    int tid;
    Registers& r;
    HostCopier& copier;
    Recorder mma;
  };

  explicit HostCta(const std::vector<Extent>* extents)
      : registers_(Cta::kThreads), copiers_(Cta::kThreads, HostCopier(extents)), records_(Cta::kWarps) {
    std::memset(static_cast<void*>(registers_.data()), 0xff, registers_.size() * sizeof(Registers));
  }

  void threads(std::function<void(Thread&)> step) {
    pending_.push_back(std::move(step));
  }

  void sync() {
    flush();
  }

  template <typename Get>
  void all_max(Get&& get) {
    flush();
    for (int warp = 0; warp < Cta::kWarps; ++warp) {
      for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
        std::vector<Registers> before(registers_.begin() + warp * kWarpSize,
                                      registers_.begin() + (warp + 1) * kWarpSize);
        for (int lane = 0; lane < kWarpSize; ++lane) {
          auto& values = get(registers_[warp * kWarpSize + lane]);
          const auto& partner = get(before[lane ^ mask]);
          for (size_t i = 0; i < std::size(values); ++i) {
            values[i] = heads_leaf::nan_max(values[i], partner[i]);
          }
        }
      }
    }
  }

  template <int... kMasks, typename Get>
  void reduce_scatter(Get&& get) {
    flush();
    for (int warp = 0; warp < Cta::kWarps; ++warp) {
      std::array<float*, kWarpSize> lanes;
      for (int lane = 0; lane < kWarpSize; ++lane) {
        lanes[lane] = get(registers_[warp * kWarpSize + lane]);
      }
      constexpr int kCount = static_cast<int>(std::extent_v<std::remove_reference_t<decltype(get(registers_[0]))>>);
      scatter_rounds<kCount, kMasks...>(lanes);
    }
  }

  // Runs what is still queued; the CTA is done.
  void finish() {
    flush();
    for (const HostCopier& copier : copiers_) {
      TORCH_INTERNAL_ASSERT(copier.idle(), "heads leaf harness: a CTA ended with copies in flight");
    }
  }

 private:
  template <int kCount, int kMask, int... kRest>
  static void scatter_rounds(const std::array<float*, kWarpSize>& lanes) {
    constexpr int kHalf = kCount / 2;
    std::array<std::array<float, kHalf>, kWarpSize> sent;
    for (int lane = 0; lane < kWarpSize; ++lane) {
      for (int i = 0; i < kHalf; ++i) {
        sent[lane][i] = heads_leaf::scatter_send(lanes[lane], i, kHalf, (lane & kMask) != 0);
      }
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
      for (int i = 0; i < kHalf; ++i) {
        lanes[lane][i] = heads_leaf::scatter_keep(lanes[lane], i, kHalf, (lane & kMask) != 0) + sent[lane ^ kMask][i];
      }
    }
    if constexpr (sizeof...(kRest) > 0) {
      scatter_rounds<kHalf, kRest...>(lanes);
    }
  }

  void flush() {
    for (int tid = 0; tid < Cta::kThreads; ++tid) {
      Thread thread{tid, registers_[tid], copiers_[tid], Recorder{&records_[tid / kWarpSize][tid % kWarpSize]}};
      for (const auto& step : pending_) {
        step(thread);
      }
    }
    pending_.clear();
    for (WarpRecord& calls : records_) {
      for (int lane = 1; lane < kWarpSize; ++lane) {
        TORCH_INTERNAL_ASSERT(calls[lane].size() == calls[0].size(), "heads leaf harness: a warp's lanes diverged");
      }
      for (size_t index = 0; index < calls[0].size(); ++index) {
        replay_mma(calls, index);
      }
      for (auto& lane_calls : calls) {
        lane_calls.clear();
      }
    }
  }

  std::vector<Registers> registers_;
  std::vector<HostCopier> copiers_;
  std::vector<WarpRecord> records_;
  std::vector<std::function<void(Thread&)>> pending_;
};

template <typename Cta>
void run_host_cta(const heads_leaf::Params& p, const std::vector<Extent>& extents, int64_t block, int64_t tile) {
  const auto shared = std::make_unique<typename Cta::Shared>();
  std::memset(static_cast<void*>(shared.get()), 0xff, sizeof(typename Cta::Shared));
  HostCta<Cta> ex(&extents);
  heads_leaf::run_cta<Cta>(p, *shared, ex, block, tile);
  ex.finish();
}

// Parents per CTA in the harness: two, so that the tests cover a block's second parent, whose tile
// is prefetched in chunks, and a partial last block.
constexpr int64_t kHarnessParents = 2;

}  // namespace

std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_on_host(const HeadsLeafOperands& ops) {
  HeadsLeafBuffers buffers = heads_leaf_buffers(ops);
  if (buffers.residual.numel() == 0) {
    return {buffers.residual, buffers.norm};
  }
  const heads_leaf::Params p = heads_leaf_params(ops, buffers, kHarnessParents);
  const int64_t right_span = (p.n - 1) * p.row_stride + (p.count - 1) * p.cols + p.cols;
  const std::vector<Extent> extents = {{p.attn, p.attn + ops.attn.numel()},
                                       {p.attn_mean, p.attn_mean + ops.attn_mean.numel()},
                                       {p.right, p.right + right_span}};
  const int64_t blocks = (p.count + p.parents_per_block - 1) / p.parents_per_block;
  heads_leaf::dispatch_cta(ops.variant, p.n, [&](auto cta) {
    using Cta = typename decltype(cta)::type;
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t tile = p.tiles - 1; tile >= 0; --tile) {
        run_host_cta<Cta>(p, extents, block, tile);
      }
    }
  });
  return {buffers.residual, buffers.norm};
}

namespace {

std::tuple<at::Tensor, at::Tensor> heads_leaf_norms_cpu(const at::Tensor& attn, const at::Tensor& attn_mean,
                                                        const at::Tensor& right, const at::Tensor& mean,
                                                        const std::optional<at::Tensor>& scale,
                                                        c10::string_view kernel) {
  return heads_leaf_norms_on_host(check_heads_leaf(attn, attn_mean, right, mean, scale, kernel));
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("_heads_leaf_norms", &heads_leaf_norms_cpu);
}

}  // namespace pathkernels
