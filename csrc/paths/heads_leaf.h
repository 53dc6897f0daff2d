// The heads leaf kernel: one launch per block of parents, covering every head (float32, TF32 tensor
// cores, sm_80 and later). For parent k (residual R_k = s_k R'_k [n, m], column means μ_k) and head
// h (C(A_h) [n, n], a_h = 1ᵀA_h/n), the leaf R = C(A_h) R_k and its column means μ = μ_k + R_kᵀ a_h
// (the centring identity, docs/DESIGN.md §1) are reduced on chip to ‖R‖_{1,∞} and ‖1μᵀ + R‖_{1,∞};
// neither R nor μ is ever stored, and no GEMV, finish kernel or per-head launch is needed.
//
// Ownership and why:
// - CTA (block, tile) owns parents block·P … block·P + P − 1 (P ≤ kMaxParents, chosen by the
//   launcher) and columns tile·kCols … of each: all rows of its leaves, so its column sums are
//   complete, and all H heads, so each parent tile is read from memory once (not once per head).
// - Shared memory: the parent tile R'_k [kRows][kCols + 8] stays on chip for its H heads; the next
//   parent's tile streams into the other of two buffers in row chunks, one with each of the current
//   parent's stages after its first. C(A_h) streams in k-slices [kRows][kDepth + 4] with a_h's slice
//   through a two-slot ring, one stage ahead of the mma (cp.async; every CTA reads the same H
//   matrices, so they come from L2). Both are copied as stored (row-major), never transposed.
// - Warp (wm, wn) of kWarpsM × kWarpsN owns rows wm·kWarpRows … and columns wn·kWarpCols … of the
//   output tile: kRowBlocks × kColBlocks m16n8 accumulators, lane = 4·group + member holding
//   MmaLayout's C elements. Its A fragments come by ldmatrix (rows padded to 4 mod 32 floats: the 8
//   rows of a phase fill 8 distinct 16-byte bank groups), its B fragments by 32-bit loads (rows
//   padded to 8 mod 32: lane (group g, member t) reads bank 8t + g).
// - Thread (q, c) = (tid / kCols, tid % kCols) owns column c's share q of a_hᵀR'_k: rows
//   q·kMeanRows … of each slice, added in k order by fused multiply-adds while the slice is on chip.
//
// Precision. "tf32x3": every operand is split in registers as it is loaded, hi = tf32(x), lo =
// tf32(x − hi) (exact, integer arithmetic: tensor_leaf.h's tf32_round), and each 8-deep step adds
// lo·hi, then hi·lo, then hi·hi into the float32 accumulators, small terms first; each pass runs
// over all of the warp's blocks, so consecutive mmas never wait on one accumulator. The dropped
// lo·lo and lo's rounding cost ~3·2⁻²² per product. "tf32": hi·hi alone (~2⁻¹¹).
// The abs sums are float32: a lane adds ≤ 8 elements in order, the warp's lanes meet in a shuffle
// tree (3 rounds for a column sum, 2 for a row sum), then ≤ 4 warps in order: every sum has depth ≤ ~16
// (relative error ≤ 16·2⁻²⁴) whatever m is; the one long chain, the row sums' fold over column
// tiles, is compensated (Kahan), so it stays at ~2 roundings for any number of tiles.
// Scales: R = s R' with s a float64 power of two (engine.h). The residual sums are of |R'|, the
// report s × their composite, as fused_leaf.h's leaf_report. The product 1μᵀ + sR' may lie outside
// float32's range where R' does not, so each parent gets a frame f = s·2^g (g ≥ 0, ParentFrame):
// its sums are of |P / f| = |2^-g R' + μ / f|, both terms in float32's range, and its report is f ×
// their composite. g > 0 only where max |μ| > 2^63 s, and then the terms 2^-g R' that leave float32's
// normal range lie below 2^-190 max |μ|, where _fused_leaf_norms' float64 sums round them away too.
// Finish. tiles = 1: the CTA owns whole leaves and writes both norms. tiles > 1: each CTA writes its
// column maxima and row sums per leaf, then counts itself in (one atomicAdd per parent, after a
// fence); the last CTA of a parent folds every tile's shares in tile order, so the result does not
// depend on which CTA came last: deterministic, bit for bit.
//
// Every step is a C10_HOST_DEVICE function of (params, shared memory, registers, thread index), and
// the CTA's whole program (run_cta below: barriers, stages, collectives) is written once, over an
// executor: on the GPU (heads_leaf_cuda.cu) it runs the calling thread's part; in the CPU harness
// (heads_leaf_cpu.cpp) it runs each segment between barriers thread after thread (so a missing
// barrier reads poisoned or stale data), emulates cp.async (the destination is NaN from the copy's
// issue until its wait), ldmatrix (by its PTX rule, from the lanes' own addresses), the shuffles
// and the mma (exact products of the lanes' fragments). What only the GPU checks: MmaLayout and the
// ldmatrix rule against the hardware, the tensor core's own rounding, the memory model of the
// cross-CTA fold, timing, and that the barriers the harness runs as segment ends are there.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/norm_math.h"
#include "paths/scales.h"
#include "paths/tensor_leaf.h"

namespace pathkernels::heads_leaf {

using fused_leaf::bits_float;
using fused_leaf::float_bits;
using fused_leaf::MmaFragments;
using fused_leaf::MmaLayout;
using fused_leaf::tf32_round;

constexpr int kWarpSize = 32;
constexpr int kMaxRows = 128;
constexpr int kStats = 2;          // per sum: |R'| (the residual), |P / f| (the product, in its frame)
constexpr int kMaxParents = 8;     // parents per CTA
constexpr int kMeanHeadroom = 64;  // |μ / f| < 2^(kMeanHeadroom + 1)
constexpr int kMaxHeads = 1 << 20;  // stage counters (heads × slices × n) stay in int
constexpr int kMmaRows = 16, kMmaCols = 8, kMmaDepth = 8;

// Kernel boundary: plain pointers, element strides, sizes.
struct Params {
  const float* attn = nullptr;       // C(A) [heads, n, n], contiguous
  const float* attn_mean = nullptr;  // a [heads, n], contiguous
  int64_t heads = 0;
  int64_t n = 0;
  const float* right = nullptr;  // parent k's R' (i, j) at k·cols + i·row_stride + j
  int64_t row_stride = 0;
  int64_t count = 0;  // parents
  int64_t cols = 0;   // m
  const float* means = nullptr;  // parent k's μ_j at k·mean_stride + j
  int64_t mean_stride = 0;
  const double* scales = nullptr;  // [count]: R_k = scales[k] · R'_k
  double* residual = nullptr;      // [count, heads]
  double* norm = nullptr;          // [count, heads]
  int64_t tiles = 0;               // column tiles
  int64_t parents_per_block = 1;   // P
  bool attn_vectors = false;       // attn and attn_mean in 16-byte copies (n % 4 == 0, aligned)
  bool right_vectors = false;      // right in 16-byte copies (m, row_stride % 4 == 0, aligned)
  float* col_shares = nullptr;     // tiles > 1: [count, heads, kStats, tiles] column maxima
  float* row_shares = nullptr;     // tiles > 1: [count, heads, kStats, tiles, n] row sums
  int* arrivals = nullptr;         // tiles > 1: [count] CTAs done with parent k, zero at launch
};

// The variants, by name: tile columns, warps, TF32 passes.
enum class Variant { kTf32x3, kTf32x3Wide, kTf32, kTf32Wide };

C10_HOST_DEVICE inline float fma32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

C10_HOST_DEVICE inline float abs32(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// The larger magnitude, NaN winning (norm_math.h's order): NaN > inf > finite on the sign-cleared
// bits, so any tree of these gives the same bits.
C10_HOST_DEVICE inline float nan_max(float a, float b) {
  const uint32_t x = scales::magnitude_bits(a), y = scales::magnitude_bits(b);
  return scales::from_magnitude_bits<float>(x > y ? x : y);
}

C10_HOST_DEVICE inline bool is_finite32(float x) {
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

// sum += x, compensated; an infinite or NaN sum stops compensating (inf − inf would turn it to NaN).
C10_HOST_DEVICE inline void kahan_add(float& sum, float& carry, float x) {
  const float y = x - carry;
  const float t = sum + y;
  carry = is_finite32(t) ? (t - sum) - y : 0.0f;
  sum = t;
}

// A parent's product frame (see the top of this file): P = sR' + μ is summed as P / f, f = s·2^g.
struct ParentFrame {
  double scale;           // s: the residual's report is s × its composite
  double unit;            // f: the product's report is f × its composite
  double scale_mantissa;  // s = scale_mantissa · 2^e, scale_mantissa in [0.5, 1)
  int mean_shift;         // μ / f = ldexp(μ / scale_mantissa, mean_shift), mean_shift = −e − g
  float residual_factor;  // s / f = 2^-g in float32 (0 below its range)
};

C10_HOST_DEVICE inline ParentFrame parent_frame(float largest_mean, double scale) {
  int scale_exponent = 0;
  const double scale_mantissa = ::frexp(scale, &scale_exponent);
  int g = 0;
  if (largest_mean > 0.0f && is_finite32(largest_mean)) {
    int mean_exponent = 0;
    ::frexp(static_cast<double>(largest_mean), &mean_exponent);
    g = mean_exponent - scale_exponent - kMeanHeadroom;
    g = g > 0 ? g : 0;
  }
  ParentFrame frame;
  frame.scale = scale;
  frame.unit = ::ldexp(scale, g);
  frame.scale_mantissa = scale_mantissa;
  frame.mean_shift = -scale_exponent - g;
  frame.residual_factor = static_cast<float>(::ldexp(1.0, -g));
  return frame;
}

C10_HOST_DEVICE inline float frame_mean(const ParentFrame& frame, float mean) {
  return static_cast<float>(::ldexp(static_cast<double>(mean) / frame.scale_mantissa, frame.mean_shift));
}

// A leaf's report of stat `stat` from its float32 maxima: s or f times their composite.
C10_HOST_DEVICE inline double heads_report(int stat, float l1, float linf, const ParentFrame& frame) {
  const double composite = composite_from_parts(static_cast<double>(l1), static_cast<double>(linf));
  return (stat == 0 ? frame.scale : frame.unit) * composite;
}

// A CTA's stage: parent `parent` of its block, head `head`, k-slice `slice`, the parent's stage
// `index` (of heads × slices), and the ring slot of its C(A) slice (stages alternate). Stages are
// counted forward (next_stage), never divided out of a 64-bit stage number.
struct Stage {
  int parent = 0;
  int head = 0;
  int slice = 0;
  int index = 0;
  int slot = 0;
};

C10_HOST_DEVICE inline Stage next_stage(Stage stage, int heads, int slices) {
  stage.slot ^= 1;
  ++stage.index;
  if (++stage.slice == slices) {
    stage.slice = 0;
    if (++stage.head == heads) {
      stage.head = 0;
      stage.index = 0;
      ++stage.parent;
    }
  }
  return stage;
}

// Stage j (1 ≤ j < stages) of a parent copies rows [chunk_begin(j), chunk_begin(j + 1)) of the next
// parent's tile: its n rows split evenly over the stages after the first (whose slot may still be
// read by the previous parent's last stage).
C10_HOST_DEVICE inline int chunk_begin(int j, int stages, int n) {
  return (j - 1) * n / (stages - 1);
}

// After a reduce-scatter over lane bits kMasks… (halving `count` values each round, a lane with the
// bit set keeping the upper half), the original index of a lane's value j.
template <int... kMasks>
C10_HOST_DEVICE inline int scattered_index(int lane, int count, int j) {
  const int masks[] = {kMasks...};
  int index = 0;
  for (const int mask : masks) {
    count /= 2;
    index += (lane & mask) ? count : 0;
  }
  return index + j;
}

// One round of that reduce-scatter for value i < half: what the lane sends, and what it keeps and
// adds the partner's value to (keep + received, on the device and in the harness alike).
C10_HOST_DEVICE inline float scatter_send(const float* v, int i, int half, bool upper) {
  return upper ? v[i] : v[i + half];
}
C10_HOST_DEVICE inline float scatter_keep(const float* v, int i, int half, bool upper) {
  return upper ? v[i + half] : v[i];
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 of 32-bit elements: lane 8q + j supplies the address of
// row j of matrix q (4 floats), and lane l receives element l % 4 of row l / 4 of matrix q in
// out[q] (the PTX ISA's rule, which the host branch applies to the lanes' own addresses).
template <typename RowAddress>
C10_HOST_DEVICE inline void load_matrix_x4(uint32_t (&out)[4], int lane, RowAddress&& row_address) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row_address(lane)));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
#else
  __trap();  // the host refuses these kernels below sm_80
#endif
#else
  for (int q = 0; q < 4; ++q) {
    out[q] = float_bits(row_address(8 * q + lane / 4)[lane % 4]);
  }
#endif
}

// The GPU's global-memory fence, its share loads past L1 and its arrival counter; in the harness,
// whose CTAs run one after another, plain memory operations.
C10_HOST_DEVICE inline void memory_fence() {
#if defined(__CUDA_ARCH__)
  __threadfence();
#endif
}

C10_HOST_DEVICE inline float load_share(const float* address) {
#if defined(__CUDA_ARCH__)
  return __ldcg(address);
#else
  return *address;
#endif
}

C10_HOST_DEVICE inline int arrive(int* counter) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(counter, 1);
#else
  return (*counter)++;
#endif
}

#if defined(__CUDA_ARCH__)
#define HEADS_LEAF_UNROLL _Pragma("unroll")
#else
#define HEADS_LEAF_UNROLL
#endif

template <int kRows_, int kCols_, int kWarps_, int kPasses_>
struct HeadsCta {
  static constexpr int kRows = kRows_;  // padded n: M and K of the product
  static constexpr int kCols = kCols_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kPasses = kPasses_;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kDepth = kRows >= 128 ? 16 : 32;  // k-slice of C(A) per stage
  static constexpr int kAttnStride = kDepth + 4;
  static constexpr int kRightStride = kCols + 8;
  static constexpr int kWarpsM = kRows >= 64 ? 2 : 1;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kWarpRows = kRows / kWarpsM;
  static constexpr int kWarpCols = kCols / kWarpsN;
  static constexpr int kRowBlocks = kWarpRows / kMmaRows;
  static constexpr int kColBlocks = kWarpCols / kMmaCols;
  static constexpr int kParts = kPasses == 3 ? 2 : 1;  // hi (and lo) of each operand
  static constexpr int kMeanSplit = kThreads / kCols;
  static constexpr int kMeanRows = kDepth / kMeanSplit;
  static constexpr int kColValues = kColBlocks * 2 * kStats;  // (n-block, column of the pair, stat)
  static constexpr int kRowValues = kRowBlocks * 2 * kStats;  // (m-block, row half, stat)
  static constexpr int kColKept = kColValues / 8;             // after 3 rounds over the lane groups
  static constexpr int kRowKept = kRowValues / 4;             // after 2 rounds over the members
  static constexpr int kAttnChunks = kDepth / 4;
  static constexpr int kRightChunks = kCols / 4;
  static_assert(kPasses == 1 || kPasses == 3, "1×TF32 or 3×TF32");
  static_assert(kRows % 32 == 0 && kRows <= kMaxRows && kRows % kDepth == 0, "tile rows");
  static_assert(kWarps % kWarpsM == 0 && kCols % (kWarpsN * kMmaCols) == 0, "warp grid");
  static_assert(kColValues % 8 == 0 && kRowValues % 4 == 0, "reduce-scatter rounds");
  static_assert(kThreads % kCols == 0 && kDepth % kMeanSplit == 0, "mean shares");
  static_assert((kAttnStride / 4) % 2 == 1 && kAttnStride % 4 == 0, "conflict-free ldmatrix");
  static_assert(kRightStride % 32 == 8, "conflict-free B fragments");
  static_assert(kWarps >= kStats, "one warp per stat finishes");

  struct alignas(16) Shared {
    float attn[2][kRows][kAttnStride];  // C(A_h) slices, row-major [i][k]
    float right[2][kRows][kRightStride];  // parent tiles R'_k, [k][j]
    float attn_mean[2][kDepth];  // a_h slices
    float mean_part[kMeanSplit][kCols];
    float col_part[kWarpsM][kStats][kCols];
    float row_part[kWarpsN][kStats][kRows];
    float parent_mean[kMaxParents][kCols];  // μ_k / f_k
    float frame_part[kMaxParents][kWarps];
    ParentFrame frame[kMaxParents];
    int last;
  };

  // CTAs per SM that registers are budgeted for (__launch_bounds__): as many as an H100's shared
  // memory (227 KB per SM) holds, but never below ~168 registers a thread, so that the fragments
  // of the next k-step fit beside the accumulators and nothing spills.
  static constexpr int kSharedBlocks = static_cast<int>((227 * 1024) / (sizeof(Shared) + 1024));
  static constexpr int kRegisterBlocks = 65536 / (kThreads * 168);
  static constexpr int kBudgetBlocks = kSharedBlocks < kRegisterBlocks ? kSharedBlocks : kRegisterBlocks;
  static constexpr int kMinBlocks = kBudgetBlocks > 0 ? kBudgetBlocks : 1;

  struct Registers {
    float acc[kRowBlocks][kColBlocks][4];
    float mean_acc;
    float col[kColValues];
    float row[kRowValues];
    float finish[2];  // l1, linf
    float frame_max[kMaxParents];
  };

  static C10_HOST_DEVICE int col_value(int nb, int j, int stat) {
    return (nb * 2 + j) * kStats + stat;
  }
  static C10_HOST_DEVICE int row_value(int mb, int half, int stat) {
    return (mb * 2 + half) * kStats + stat;
  }

  // The thread's registers cleared; rows n … kRows − 1 of both parent buffers zeroed (the mma's
  // last k-step and the means read them against zero columns of C(A); nothing writes them later);
  // the thread's share of max |μ_k| of each parent.
  static C10_HOST_DEVICE void start(const Params& p, Shared& s, Registers& r, int tid, int64_t first, int count) {
    HEADS_LEAF_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
      HEADS_LEAF_UNROLL
      for (int nb = 0; nb < kColBlocks; ++nb) {
        HEADS_LEAF_UNROLL
        for (int e = 0; e < 4; ++e) {
          r.acc[mb][nb][e] = 0.0f;
        }
      }
    }
    r.mean_acc = 0.0f;
    const int n = static_cast<int>(p.n);
    const int pad = (kRows - n) * kRightStride;
    for (int buffer = 0; buffer < 2; ++buffer) {
      float* rows = &s.right[buffer][0][0] + n * kRightStride;
      for (int e = tid; e < pad; e += kThreads) {
        rows[e] = 0.0f;
      }
    }
    HEADS_LEAF_UNROLL
    for (int q = 0; q < kMaxParents; ++q) {
      float largest = 0.0f;
      if (q < count) {
        const float* mean = p.means + (first + q) * p.mean_stride;
        for (int64_t j = tid; j < p.cols; j += kThreads) {
          largest = nan_max(largest, mean[j]);
        }
      }
      r.frame_max[q] = largest;
    }
  }

  static C10_HOST_DEVICE void frame_write(Shared& s, const Registers& r, int tid) {
    if (tid % kWarpSize == 0) {
      HEADS_LEAF_UNROLL
      for (int q = 0; q < kMaxParents; ++q) {
        s.frame_part[q][tid / kWarpSize] = r.frame_max[q];
      }
    }
  }

  // Thread q < count owns parent q's frame.
  static C10_HOST_DEVICE void frame_finish(const Params& p, Shared& s, int tid, int64_t first, int count) {
    if (tid < count) {
      float largest = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        largest = nan_max(largest, s.frame_part[tid][w]);
      }
      s.frame[tid] = parent_frame(largest, p.scales[first + tid]);
    }
  }

  static C10_HOST_DEVICE void parent_means(const Params& p, Shared& s, int tid, int64_t first, int count,
                                           int64_t tile) {
    for (int e = tid; e < count * kCols; e += kThreads) {
      const int q = e / kCols, c = e % kCols;
      const int64_t col = tile * kCols + c;
      s.parent_mean[q][c] = col < p.cols ? frame_mean(s.frame[q], p.means[(first + q) * p.mean_stride + col]) : 0.0f;
    }
  }

  // Rows [row_begin, row_end) of parent `leaf`'s tile into parent buffer `buffer`; columns past m
  // are left as they are (they only reach output columns that are never summed).
  template <typename Copier>
  static C10_HOST_DEVICE void copy_parent(const Params& p, Shared& s, int tid, int64_t leaf, int buffer, int row_begin,
                                          int row_end, int64_t tile, Copier& copier) {
    const float* right = p.right + leaf * p.cols + tile * kCols;
    const int64_t inside = p.cols - tile * kCols;
    if (p.right_vectors) {
      for (int e = tid; e < (row_end - row_begin) * kRightChunks; e += kThreads) {
        const int i = row_begin + e / kRightChunks, c = 4 * (e % kRightChunks);
        if (c < inside) {
          copier.copy16(&s.right[buffer][i][c], right + i * p.row_stride + c, true);
        }
      }
    } else {
      for (int e = tid; e < (row_end - row_begin) * kCols; e += kThreads) {
        const int i = row_begin + e / kCols, c = e % kCols;
        if (c < inside) {
          copier.copy4(&s.right[buffer][i][c], right + i * p.row_stride + c, true);
        }
      }
    }
  }

  // Stage u's copies: C(A_h)'s slice and a_h's (zero past n) into slot u % 2, and the parent tiles
  // due with it: a parent's first stage brings its own whole tile when nothing could prefetch it
  // (the block's first parent, or one stage per parent); stages 1 … of parent k bring parent k + 1's.
  template <typename Copier>
  static C10_HOST_DEVICE void issue(const Params& p, Shared& s, int tid, int64_t first, int count, int slices,
                                    int64_t tile, const Stage& stage, Copier& copier) {
    const int slot = stage.slot;
    const int n = static_cast<int>(p.n);
    const int k0 = stage.slice * kDepth;
    const float* attn = p.attn + static_cast<int64_t>(stage.head) * n * n;
    const float* attn_mean = p.attn_mean + static_cast<int64_t>(stage.head) * n;
    if (p.attn_vectors) {
      for (int e = tid; e < n * kAttnChunks; e += kThreads) {
        const int i = e / kAttnChunks, kk = 4 * (e % kAttnChunks);
        const bool inside = k0 + kk < n;
        copier.copy16(&s.attn[slot][i][kk], inside ? attn + i * n + k0 + kk : attn, inside);
      }
      for (int e = tid; e < kAttnChunks; e += kThreads) {
        const bool inside = k0 + 4 * e < n;
        copier.copy16(&s.attn_mean[slot][4 * e], inside ? attn_mean + k0 + 4 * e : attn_mean, inside);
      }
    } else {
      for (int e = tid; e < n * kDepth; e += kThreads) {
        const int i = e / kDepth, kk = e % kDepth;
        const bool inside = k0 + kk < n;
        copier.copy4(&s.attn[slot][i][kk], inside ? attn + i * n + k0 + kk : attn, inside);
      }
      for (int kk = tid; kk < kDepth; kk += kThreads) {
        const bool inside = k0 + kk < n;
        copier.copy4(&s.attn_mean[slot][kk], inside ? attn_mean + k0 + kk : attn_mean, inside);
      }
    }
    const int per_parent = static_cast<int>(p.heads) * slices;
    if (stage.index == 0 && (stage.parent == 0 || per_parent == 1)) {
      copy_parent(p, s, tid, first + stage.parent, stage.parent & 1, 0, n, tile, copier);
    } else if (stage.index >= 1 && stage.parent + 1 < count) {
      copy_parent(p, s, tid, first + stage.parent + 1, (stage.parent + 1) & 1, chunk_begin(stage.index, per_parent, n),
                  chunk_begin(stage.index + 1, per_parent, n), tile, copier);
    }
  }

  // hi (and lo) of x, as the mma reads them.
  static C10_HOST_DEVICE void split(float x, uint32_t& hi, uint32_t& lo) {
    const float high = tf32_round(x);
    hi = float_bits(high);
    if constexpr (kParts == 2) {
      lo = float_bits(tf32_round(x - high));  // exact: high is x with fewer bits
    }
  }

  // Which parts a pass multiplies, small terms first: lo·hi, hi·lo, hi·hi (0 = hi, 1 = lo).
  static C10_HOST_DEVICE int pass_a(int pass) {
    return kPasses == 1 ? 0 : (pass == 0 ? 1 : 0);
  }
  static C10_HOST_DEVICE int pass_b(int pass) {
    return kPasses == 1 ? 0 : (pass == 1 ? 1 : 0);
  }

  // Stage u's products into the warp's accumulators (mma: the warp-collective instruction), and the
  // thread's share of a_hᵀR' over the slice's rows. m-blocks wholly past n are skipped (warp-uniform).
  template <typename Mma>
  static C10_HOST_DEVICE void multiply(const Params& p, const Shared& s, Registers& r, int tid, const Stage& stage,
                                       Mma&& mma) {
    const int slot = stage.slot, buffer = stage.parent & 1;
    const int n = static_cast<int>(p.n);
    const int k0 = stage.slice * kDepth;
    const int depth = n - k0 < kDepth ? n - k0 : kDepth;
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int row0 = (warp / kWarpsN) * kWarpRows, col0 = (warp % kWarpsN) * kWarpCols;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
    for (int k8 = 0; k8 < depth; k8 += kMmaDepth) {
      uint32_t b[kParts][kColBlocks][2] = {};
      HEADS_LEAF_UNROLL
      for (int nb = 0; nb < kColBlocks; ++nb) {
        HEADS_LEAF_UNROLL
        for (int e = 0; e < 2; ++e) {
          const int k = k0 + k8 + MmaLayout::b_row(lane, e), c = col0 + nb * kMmaCols + MmaLayout::b_col(lane);
          split(s.right[buffer][k][c], b[0][nb][e], b[kParts - 1][nb][e]);
        }
      }
      uint32_t a[kParts][kRowBlocks][4] = {};
      HEADS_LEAF_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
        if (row0 + mb * kMmaRows < n) {
          const int rows = row0 + mb * kMmaRows;
          uint32_t raw[4];
          load_matrix_x4(raw, lane, [&](int l) -> const float* {
            return &s.attn[slot][rows + l % 8 + 8 * ((l / 8) % 2)][k8 + 4 * (l / 16)];
          });
          HEADS_LEAF_UNROLL
          for (int e = 0; e < 4; ++e) {
            split(bits_float(raw[e]), a[0][mb][e], a[kParts - 1][mb][e]);
          }
        }
      }
      HEADS_LEAF_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        HEADS_LEAF_UNROLL
        for (int mb = 0; mb < kRowBlocks; ++mb) {
          if (row0 + mb * kMmaRows < n) {
            HEADS_LEAF_UNROLL
            for (int nb = 0; nb < kColBlocks; ++nb) {
              const uint32_t(&pa)[4] = a[pass_a(pass)][mb];
              const uint32_t(&pb)[2] = b[pass_b(pass)][nb];
              mma(r.acc[mb][nb], MmaFragments{{pa[0], pa[1], pa[2], pa[3]}, {pb[0], pb[1]}});
            }
          }
        }
      }
    }
    const int c = tid % kCols, q = tid / kCols;
    HEADS_LEAF_UNROLL
    for (int kk = q * kMeanRows; kk < (q + 1) * kMeanRows; ++kk) {
      r.mean_acc = fma32(s.attn_mean[slot][kk], s.right[buffer][k0 + kk][c], r.mean_acc);
    }
  }

  static C10_HOST_DEVICE void write_means(Shared& s, Registers& r, int tid) {
    s.mean_part[tid / kCols][tid % kCols] = r.mean_acc;
    r.mean_acc = 0.0f;
  }

  // The lane's elements of the finished leaf into its abs sums (zero outside the matrix): per owned
  // column over its rows, per owned row over its columns; the accumulators cleared for the next head.
  static C10_HOST_DEVICE void leaf_values(const Params& p, const Shared& s, Registers& r, int tid, int parent,
                                          int64_t tile) {
    const float factor = s.frame[parent].residual_factor;
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int row0 = (warp / kWarpsN) * kWarpRows, col0 = (warp % kWarpsN) * kWarpCols;
    float mean[kColBlocks][2];
    bool col_inside[kColBlocks][2];
    HEADS_LEAF_UNROLL
    for (int nb = 0; nb < kColBlocks; ++nb) {
      HEADS_LEAF_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int c = col0 + nb * kMmaCols + 2 * (lane % 4) + j;
        float dot = s.mean_part[0][c];
        HEADS_LEAF_UNROLL
        for (int q = 1; q < kMeanSplit; ++q) {
          dot += s.mean_part[q][c];
        }
        mean[nb][j] = fma32(factor, dot, s.parent_mean[parent][c]);  // μ / f = μ_k / f + 2^-g a_hᵀR'
        col_inside[nb][j] = tile * kCols + c < p.cols;
      }
    }
    HEADS_LEAF_UNROLL
    for (int i = 0; i < kColValues; ++i) {
      r.col[i] = 0.0f;
    }
    HEADS_LEAF_UNROLL
    for (int i = 0; i < kRowValues; ++i) {
      r.row[i] = 0.0f;
    }
    HEADS_LEAF_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
      HEADS_LEAF_UNROLL
      for (int half = 0; half < 2; ++half) {
        const bool row_inside = row0 + mb * kMmaRows + lane / 4 + 8 * half < p.n;
        HEADS_LEAF_UNROLL
        for (int nb = 0; nb < kColBlocks; ++nb) {
          HEADS_LEAF_UNROLL
          for (int j = 0; j < 2; ++j) {
            float& v = r.acc[mb][nb][2 * half + j];
            if (row_inside && col_inside[nb][j]) {
              const float residual = abs32(v);
              const float product = abs32(fma32(v, factor, mean[nb][j]));
              r.row[row_value(mb, half, 0)] += residual;
              r.row[row_value(mb, half, 1)] += product;
              r.col[col_value(nb, j, 0)] += residual;
              r.col[col_value(nb, j, 1)] += product;
            }
            v = 0.0f;
          }
        }
      }
    }
  }

  // After the reduce-scatters: the lane's warp totals into the CTA's column and row shares.
  static C10_HOST_DEVICE void write_parts(Shared& s, const Registers& r, int tid) {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
    const int row0 = warp_m * kWarpRows, col0 = warp_n * kWarpCols;
    HEADS_LEAF_UNROLL
    for (int k = 0; k < kColKept; ++k) {
      const int index = scattered_index<16, 8, 4>(lane, kColValues, k);
      const int stat = index % kStats, j = (index / kStats) % 2, nb = index / (2 * kStats);
      s.col_part[warp_m][stat][col0 + nb * kMmaCols + 2 * (lane % 4) + j] = r.col[k];
    }
    HEADS_LEAF_UNROLL
    for (int k = 0; k < kRowKept; ++k) {
      const int index = scattered_index<2, 1>(lane, kRowValues, k);
      const int stat = index % kStats, half = (index / kStats) % 2, mb = index / (2 * kStats);
      s.row_part[warp_n][stat][row0 + mb * kMmaRows + lane / 4 + 8 * half] = r.row[k];
    }
  }

  // Warp `stat` (< kStats) owns stat `stat` of the leaf: its lanes' maxima of the complete column
  // sums and of the row sums (tiles = 1), or the row sums written as this tile's shares (tiles > 1).
  static C10_HOST_DEVICE void finish_local(const Params& p, const Shared& s, Registers& r, int tid, int64_t leaf,
                                           int64_t head, int64_t tile) {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    float l1 = 0.0f, linf = 0.0f;
    if (warp < kStats) {
      const int stat = warp;
      HEADS_LEAF_UNROLL
      for (int c = lane; c < kCols; c += kWarpSize) {
        if (tile * kCols + c < p.cols) {
          float total = s.col_part[0][stat][c];
          HEADS_LEAF_UNROLL
          for (int w = 1; w < kWarpsM; ++w) {
            total += s.col_part[w][stat][c];
          }
          l1 = nan_max(l1, total);
        }
      }
      float* shares =
          p.tiles > 1 ? p.row_shares + (((leaf * p.heads + head) * kStats + stat) * p.tiles + tile) * p.n : nullptr;
      for (int i = lane; i < p.n; i += kWarpSize) {
        float total = s.row_part[0][stat][i];
        HEADS_LEAF_UNROLL
        for (int w = 1; w < kWarpsN; ++w) {
          total += s.row_part[w][stat][i];
        }
        if (shares != nullptr) {
          shares[i] = total;
        } else {
          linf = nan_max(linf, total);
        }
      }
    }
    r.finish[0] = l1;
    r.finish[1] = linf;
  }

  static C10_HOST_DEVICE void finish_write(const Params& p, const Shared& s, const Registers& r, int tid, int parent,
                                           int64_t leaf, int64_t head, int64_t tile) {
    const int warp = tid / kWarpSize;
    if (warp < kStats && tid % kWarpSize == 0) {
      const int stat = warp;
      if (p.tiles == 1) {
        (stat == 0 ? p.residual : p.norm)[leaf * p.heads + head] =
            heads_report(stat, r.finish[0], r.finish[1], s.frame[parent]);
      } else {
        p.col_shares[((leaf * p.heads + head) * kStats + stat) * p.tiles + tile] = r.finish[0];
      }
    }
  }

  static C10_HOST_DEVICE void count_in(const Params& p, Shared& s, int tid, int64_t leaf) {
    if (tid == 0) {
      s.last = arrive(p.arrivals + leaf) == p.tiles - 1;
    }
  }

  // The last CTA of a parent, round `round`: warp w owns (head, stat) pair w + round·kWarps of the
  // parent's leaves; its lanes take the maxima of the tiles' column maxima and of the row sums,
  // each folded over the tiles in tile order.
  static C10_HOST_DEVICE void fold_local(const Params& p, Registers& r, int tid, int64_t leaf, int round) {
    const int warp = tid / kWarpSize, lane = tid % kWarpSize;
    const int64_t pair = warp + static_cast<int64_t>(round) * kWarps;
    float l1 = 0.0f, linf = 0.0f;
    if (pair < p.heads * kStats) {
      const int64_t base = (leaf * p.heads * kStats + pair) * p.tiles;
      for (int64_t t = lane; t < p.tiles; t += kWarpSize) {
        l1 = nan_max(l1, load_share(p.col_shares + base + t));
      }
      for (int64_t i = lane; i < p.n; i += kWarpSize) {
        float sum = 0.0f, carry = 0.0f;
        for (int64_t t = 0; t < p.tiles; ++t) {
          kahan_add(sum, carry, load_share(p.row_shares + (base + t) * p.n + i));
        }
        linf = nan_max(linf, sum);
      }
    }
    r.finish[0] = l1;
    r.finish[1] = linf;
  }

  static C10_HOST_DEVICE void fold_write(const Params& p, const Shared& s, const Registers& r, int tid, int parent,
                                         int64_t leaf, int round) {
    const int warp = tid / kWarpSize;
    const int64_t pair = warp + static_cast<int64_t>(round) * kWarps;
    if (pair < p.heads * kStats && tid % kWarpSize == 0) {
      const int stat = static_cast<int>(pair % kStats);
      (stat == 0 ? p.residual : p.norm)[leaf * p.heads + pair / kStats] =
          heads_report(stat, r.finish[0], r.finish[1], s.frame[parent]);
    }
  }
};

// The CTA's program, written once for the GPU and the harness. `ex` provides
//   threads(fn): fn(thread) for the calling thread (GPU) or for each thread (harness), where thread
//     has .tid, .r (Registers), .copier (copy16, copy4, commit, wait_all: cp.async) and .mma;
//   sync(): __syncthreads();
//   all_max(get) and reduce_scatter<masks…>(get): the warp collectives on the array get(registers).
// Every lambda captures by value: the harness may run it after the program has moved on.
template <typename Cta, typename Exec>
C10_HOST_DEVICE void run_cta(const Params& params, typename Cta::Shared& shared, Exec& ex, int64_t block,
                             int64_t tile) {
  const Params* const pp = &params;
  typename Cta::Shared* const s = &shared;
  const int64_t first = block * params.parents_per_block;
  const int64_t left = params.count - first;
  const int count = static_cast<int>(left < params.parents_per_block ? left : params.parents_per_block);
  const int slices = static_cast<int>((params.n + Cta::kDepth - 1) / Cta::kDepth);
  const int heads = static_cast<int>(params.heads);
  const int64_t stages = static_cast<int64_t>(count) * heads * slices;

  ex.threads([=](auto& th) { Cta::start(*pp, *s, th.r, th.tid, first, count); });
  ex.all_max([](auto& r) -> auto& { return r.frame_max; });
  ex.threads([=](auto& th) { Cta::frame_write(*s, th.r, th.tid); });
  ex.sync();
  ex.threads([=](auto& th) { Cta::frame_finish(*pp, *s, th.tid, first, count); });
  ex.sync();
  ex.threads([=](auto& th) {
    Cta::parent_means(*pp, *s, th.tid, first, count, tile);
    Cta::issue(*pp, *s, th.tid, first, count, slices, tile, Stage{}, th.copier);
    th.copier.commit();
  });
  Stage stage;
  for (int64_t u = 0; u < stages; ++u, stage = next_stage(stage, heads, slices)) {
    ex.threads([](auto& th) { th.copier.wait_all(); });
    ex.sync();  // stage u's operands are in; every thread is done with stage u − 1's slot
    const bool more = u + 1 < stages;
    const Stage next = next_stage(stage, heads, slices);
    ex.threads([=](auto& th) {
      if (more) {
        Cta::issue(*pp, *s, th.tid, first, count, slices, tile, next, th.copier);
      }
      th.copier.commit();
      Cta::multiply(*pp, *s, th.r, th.tid, stage, th.mma);
    });
    if (stage.slice + 1 < slices) {
      continue;
    }
    const int64_t leaf = first + stage.parent;
    const int parent = stage.parent;
    const int64_t head = stage.head;
    ex.threads([=](auto& th) { Cta::write_means(*s, th.r, th.tid); });
    ex.sync();
    ex.threads([=](auto& th) { Cta::leaf_values(*pp, *s, th.r, th.tid, parent, tile); });
    ex.template reduce_scatter<16, 8, 4>([](auto& r) -> auto& { return r.col; });
    ex.template reduce_scatter<2, 1>([](auto& r) -> auto& { return r.row; });
    ex.threads([=](auto& th) { Cta::write_parts(*s, th.r, th.tid); });
    ex.sync();
    ex.threads([=](auto& th) { Cta::finish_local(*pp, *s, th.r, th.tid, leaf, head, tile); });
    ex.all_max([](auto& r) -> auto& { return r.finish; });
    ex.threads([=](auto& th) { Cta::finish_write(*pp, *s, th.r, th.tid, parent, leaf, head, tile); });
    if (params.tiles == 1 || head + 1 < heads) {
      continue;
    }
    // The parent's shares are written: count in; the last CTA folds them all.
    ex.threads([](auto&) { memory_fence(); });
    ex.sync();
    ex.threads([=](auto& th) { Cta::count_in(*pp, *s, th.tid, leaf); });
    ex.sync();
    if (!s->last) {
      continue;
    }
    ex.threads([](auto&) { memory_fence(); });
    const int64_t rounds = (params.heads * kStats + Cta::kWarps - 1) / Cta::kWarps;
    for (int round = 0; round < rounds; ++round) {
      ex.threads([=](auto& th) { Cta::fold_local(*pp, th.r, th.tid, leaf, round); });
      ex.all_max([](auto& r) -> auto& { return r.finish; });
      ex.threads([=](auto& th) { Cta::fold_write(*pp, *s, th.r, th.tid, parent, leaf, round); });
    }
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<Cta>) with the CTA of `variant` for n rows (tile rows: the smallest of 32, 64,
// 128 that holds n).
template <typename Fn>
void dispatch_cta(Variant variant, int64_t n, Fn&& fn) {
  const auto rows = [&](auto columns, auto warps, auto passes) {
    constexpr int kCols = decltype(columns)::value, kWarps = decltype(warps)::value;
    constexpr int kPasses = decltype(passes)::value;
    if (n <= 32) {
      fn(TypeTag<HeadsCta<32, kCols, kWarps, kPasses>>{});
    } else if (n <= 64) {
      fn(TypeTag<HeadsCta<64, kCols, kWarps, kPasses>>{});
    } else {
      fn(TypeTag<HeadsCta<128, kCols, kWarps, kPasses>>{});
    }
  };
  using C64 = std::integral_constant<int, 64>;
  using C128 = std::integral_constant<int, 128>;
  using W4 = std::integral_constant<int, 4>;
  using W8 = std::integral_constant<int, 8>;
  using P1 = std::integral_constant<int, 1>;
  using P3 = std::integral_constant<int, 3>;
  switch (variant) {
    case Variant::kTf32x3:
      return rows(C64{}, W4{}, P3{});
    case Variant::kTf32x3Wide:
      return rows(C128{}, W8{}, P3{});
    case Variant::kTf32:
      return rows(C64{}, W4{}, P1{});
    case Variant::kTf32Wide:
      return rows(C128{}, W8{}, P1{});
  }
}

}  // namespace pathkernels::heads_leaf
