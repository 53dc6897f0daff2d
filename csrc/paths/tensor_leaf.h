// The fused leaf kernel on tensor cores: the same CTA work as fused_leaf.h's SIMT
// tile, one column tile of one float32 leaf R' = C(A) · right_k reduced on chip to its abs sums,
// with the product on TF32 tensor cores (mma.sync m16n8k8, sm_80 and later).
//
// Precision. TF32 keeps 10 of float32's 23 mantissa bits. With kPasses = 3 every operand is split
// exactly into hi + lo, hi = tf32(x) and lo = tf32(x − hi), and each product is taken as
// lo·hi + hi·lo + hi·hi (lo·lo, below 2⁻²² of the product, is dropped), accumulated in float32:
// float32 accuracy on tensor cores ("3×TF32"). kPasses = 1 takes hi·hi only ("1×TF32", about 2⁻¹¹
// relative per product): path_residuals' fast mode. The split is plain integer arithmetic on the
// float's bits (tf32_round), the same on the host and the device, so the CPU harness splits
// exactly as the GPU does.
//
// Ownership. The CTA's 4 warps split the tile's 64 columns: warp w owns columns 16w … 16w + 15 (two
// 8-column n-blocks) of every row (kRows / 16 m-blocks). Within an mma, lane = 4·group + member
// holds the fragment elements of MmaLayout below (the PTX ISA's layout for .tf32 m16n8k8).
//
// Every step is a C10_HOST_DEVICE function of (params, shared tile, registers, thread index), as
// in fused_leaf.h. The one warp-collective step, the mma itself, is a callable passed to multiply:
// on the GPU the mma.sync instruction (paths_cuda.cu), in the CPU harness (fused_leaf_cpu.cpp) a
// recorder whose calls are then replayed as 16 × 8 × 8 products of the 32 lanes' fragments. What
// the harness cannot check is MmaLayout against the hardware; the GPU suite compares the kernel
// with the float64 reference and with the SIMT kernel.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>
#include <cstring>

#include "paths/fused_leaf.h"

namespace pathkernels::fused_leaf {

constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;                  // 4
constexpr int kMmaRows = 16, kMmaCols = 8, kMmaDepth = 8;     // m16n8k8
constexpr int kWarpCols = kTileCols / kWarps;                 // 16 columns per warp
constexpr int kWarpColBlocks = kWarpCols / kMmaCols;          // 2 n-blocks per warp
static_assert(kTileDepth % kMmaDepth == 0 && kWarpCols % kMmaCols == 0, "mma tiling");
// The epilogue's shares match TileSums: per column one per lane group, per row one per (warp, member).
static_assert(kThreadRows == kWarpSize / 4 && kThreadCols == kWarps * 4, "tensor tile sums");

// The float's bits, and back (no aliasing UB on the host; free on the device).
C10_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

C10_HOST_DEVICE inline float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
#endif
}

// x rounded to TF32 (10 mantissa bits; to nearest, ties away from zero, as cvt.rna.tf32.f32), as
// a float whose low 13 bits are zero, so that the tensor core, which ignores them, reads it
// exactly. Infinities and NaNs pass unchanged (their bits must not carry into the sign).
C10_HOST_DEVICE inline float tf32_round(float x) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return x;
  }
  return bits_float((bits + 0x1000u) & 0xffffe000u);
}

// Which element of the 16 × 8 (A), 8 × 8 (B) and 16 × 8 (C, D) operands register r of a lane holds
// in mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32; group = lane / 4, member = lane % 4.
struct MmaLayout {
  static C10_HOST_DEVICE int a_row(int lane, int r) { return lane / 4 + 8 * (r & 1); }
  static C10_HOST_DEVICE int a_col(int lane, int r) { return lane % 4 + 4 * (r >> 1); }
  static C10_HOST_DEVICE int b_row(int lane, int r) { return lane % 4 + 4 * r; }
  static C10_HOST_DEVICE int b_col(int lane) { return lane / 4; }
  static C10_HOST_DEVICE int c_row(int lane, int r) { return lane / 4 + 8 * (r >> 1); }
  static C10_HOST_DEVICE int c_col(int lane, int r) { return 2 * (lane % 4) + (r & 1); }
};

// One mma's operands, as the instruction takes them.
struct MmaFragments {
  uint32_t a[4];
  uint32_t b[2];
};

template <int kRows, int kPasses>
struct TensorTile {
  static_assert(kPasses == 1 || kPasses == 3, "1×TF32 or 3×TF32");
  static_assert(kRows % kMmaRows == 0 && kRows <= kMaxRows, "tile rows");
  using T = float;
  using A = double;
  using Element = T;
  static constexpr bool kTensorCores = true;
  static constexpr int kParts = kPasses == 3 ? 2 : 1;  // hi (and lo) of each operand
  static constexpr int kRowBlocks = kRows / kMmaRows;
  // Rows of the staged operands are padded by 8 floats: lane (group g, member t) of a fragment load
  // reads row t (+4) at offset g, and with a row length ≡ 8 (mod 32) banks 8t + g are all distinct.
  static constexpr int kPad = 8;
  static_assert((kRows + kPad) % 32 == 8 && (kTileCols + kPad) % 32 == 8, "conflict-free fragment loads");

  // The passes of each product, small terms first: (part of A, part of B), 0 = hi, 1 = lo.
  static C10_HOST_DEVICE int pass_a(int pass) { return kPasses == 1 ? 0 : (pass == 0 ? 1 : 0); }
  static C10_HOST_DEVICE int pass_b(int pass) { return kPasses == 1 ? 0 : (pass == 1 ? 1 : 0); }

  struct Operands {
    T attn[kParts][kTileDepth][kRows + kPad];  // k-major, split
    T right[kParts][kTileDepth][kTileCols + kPad];
  };
  using Shared = TileShared<Operands, A, kRows>;
  struct Registers {
    T acc[kRowBlocks][kWarpColBlocks][4];
  };

  static C10_HOST_DEVICE void clear(Registers& r) {
    PATHKERNELS_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
      PATHKERNELS_UNROLL
      for (int nb = 0; nb < kWarpColBlocks; ++nb) {
        PATHKERNELS_UNROLL
        for (int e = 0; e < 4; ++e) {
          r.acc[mb][nb][e] = T(0);
        }
      }
    }
  }

  // Stores x's TF32 parts at part-major position [.][kk][index] of a staged operand.
  template <int kWidth>
  static C10_HOST_DEVICE void store_split(T (&dst)[kParts][kTileDepth][kWidth], int kk, int index, T x) {
    const T hi = tf32_round(x);
    dst[0][kk][index] = hi;
    if constexpr (kParts == 2) {
      dst[1][kk][index] = tf32_round(x - hi);  // x − hi is exact: hi is x with fewer bits
    }
  }

  // The SIMT tile's staging pattern, each value split once on its way into shared memory.
  static C10_HOST_DEVICE void load(const Params& p, Shared& s, int tid, int64_t leaf, int64_t tile, int64_t k0) {
    stage_slice<T, kRows>(
        p, tid, leaf, tile, k0, [&](int kk, int row, T v) { store_split(s.operands.attn, kk, row, v); },
        [&](int kk, int c, T v) { store_split(s.operands.right, kk, c, v); });
  }

  // acc += the staged slice's contribution to the warp's columns: per 8-deep step, the B fragments
  // of the warp's n-blocks, then per m-block its A fragments and kPasses mmas per n-block.
  // mma(acc[4], fragments) is the warp-collective instruction (see the top of this file).
  template <typename Mma>
  static C10_HOST_DEVICE void multiply(const Shared& s, Registers& r, int tid, Mma&& mma) {
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    PATHKERNELS_UNROLL
    for (int k8 = 0; k8 < kTileDepth; k8 += kMmaDepth) {
      uint32_t b[kParts][kWarpColBlocks][2];
      PATHKERNELS_UNROLL
      for (int part = 0; part < kParts; ++part) {
        PATHKERNELS_UNROLL
        for (int nb = 0; nb < kWarpColBlocks; ++nb) {
          PATHKERNELS_UNROLL
          for (int e = 0; e < 2; ++e) {
            const int c = warp * kWarpCols + nb * kMmaCols + MmaLayout::b_col(lane);
            b[part][nb][e] = float_bits(s.operands.right[part][k8 + MmaLayout::b_row(lane, e)][c]);
          }
        }
      }
      PATHKERNELS_UNROLL
      for (int mb = 0; mb < kRowBlocks; ++mb) {
        uint32_t a[kParts][4];
        PATHKERNELS_UNROLL
        for (int part = 0; part < kParts; ++part) {
          PATHKERNELS_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int row = mb * kMmaRows + MmaLayout::a_row(lane, e);
            a[part][e] = float_bits(s.operands.attn[part][k8 + MmaLayout::a_col(lane, e)][row]);
          }
        }
        PATHKERNELS_UNROLL
        for (int nb = 0; nb < kWarpColBlocks; ++nb) {
          PATHKERNELS_UNROLL
          for (int pass = 0; pass < kPasses; ++pass) {
            const uint32_t(&pa)[4] = a[pass_a(pass)];
            const uint32_t(&pb)[2] = b[pass_b(pass)][nb];
            const MmaFragments fragments{{pa[0], pa[1], pa[2], pa[3]}, {pb[0], pb[1]}};
            mma(r.acc[mb][nb], fragments);
          }
        }
      }
    }
  }

  // The lane's abs sums of R' and of sR' + μ into TileSums: per owned column over its rows (share
  // = the lane's group), per owned row over its columns (share = 4·warp + member). Every share is
  // written, zero where the lane owns nothing inside the matrix.
  static C10_HOST_DEVICE void partial_sums(const Params& p, Shared& s, const Registers& r, int tid, int64_t leaf,
                                           int64_t tile) {
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const int group = lane / 4;
    const int row_share = warp * 4 + lane % 4;
    const A scale = static_cast<A>(p.scales[leaf]);
    A col_sums[kWarpColBlocks][2][kStats] = {};  // per n-block, per column of the lane (2·member + j)
    PATHKERNELS_UNROLL
    for (int mb = 0; mb < kRowBlocks; ++mb) {
      PATHKERNELS_UNROLL
      for (int half = 0; half < 2; ++half) {  // rows group and group + 8 of the m-block
        const int row = mb * kMmaRows + MmaLayout::c_row(lane, 2 * half);
        A row_sums[kStats] = {};
        PATHKERNELS_UNROLL
        for (int nb = 0; nb < kWarpColBlocks; ++nb) {
          PATHKERNELS_UNROLL
          for (int j = 0; j < 2; ++j) {
            const int e = 2 * half + j;
            const int c = warp * kWarpCols + nb * kMmaCols + MmaLayout::c_col(lane, e);
            if (row < p.n && tile * kTileCols + c < p.cols) {
              add_element(static_cast<A>(r.acc[mb][nb][e]), scale, s.mean[c], row_sums, col_sums[nb][j]);
            }
          }
        }
        s.sums.row[row][row_share][0] = row_sums[0];
        s.sums.row[row][row_share][1] = row_sums[1];
      }
    }
    PATHKERNELS_UNROLL
    for (int nb = 0; nb < kWarpColBlocks; ++nb) {
      PATHKERNELS_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int c = warp * kWarpCols + nb * kMmaCols + MmaLayout::c_col(lane, j);
        s.sums.col[group][c][0] = col_sums[nb][j][0];
        s.sums.col[group][c][1] = col_sums[nb][j][1];
      }
    }
  }
};

}  // namespace pathkernels::fused_leaf
