// Scalar math shared by the CPU and CUDA norm kernels. One copy, compiled for host and device,
// so that both backends make the same choices about accumulation, ties, NaN and zero norms.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace pathkernels {

// Accumulation type of the norm reductions: half and bfloat16 accumulate in float; float32
// accumulates in double, so that sums over long rows keep every digit the output can show.
template <typename T>
struct NormAcc {
  using type = double;
};
template <>
struct NormAcc<c10::Half> {
  using type = float;
};
template <>
struct NormAcc<c10::BFloat16> {
  using type = float;
};
template <typename T>
using norm_acc_t = typename NormAcc<T>::type;

template <typename A>
C10_HOST_DEVICE inline bool is_nan(A v) {
  return v != v;
}

// The order behind every max/argmax of the norms: NaN beats any number (NaN propagates as in
// torch.amax); among equal values the smaller index wins. A sequential scan and a parallel tree
// of merges therefore pick the same index.
template <typename A>
C10_HOST_DEVICE inline bool max_beats(A value, int64_t index, A best, int64_t best_index) {
  if (is_nan(value) || is_nan(best)) {
    return is_nan(value) && (!is_nan(best) || index < best_index);
  }
  return value > best || (value == best && index < best_index);
}

template <typename A>
C10_HOST_DEVICE inline void max_update(A value, int64_t index, A& best, int64_t& best_index) {
  if (max_beats(value, index, best, best_index)) {
    best = value;
    best_index = index;
  }
}

// The smallest normal number of A, as a literal (usable in device code without relaxed constexpr).
template <typename A>
C10_HOST_DEVICE constexpr A smallest_normal();
template <>
C10_HOST_DEVICE constexpr double smallest_normal<double>() {
  return 2.2250738585072014e-308;
}
template <>
C10_HOST_DEVICE constexpr float smallest_normal<float>() {
  return 1.17549435e-38f;
}

// ‖M‖_{1,∞} = sqrt(‖M‖_1 ‖M‖_∞), from the two maxima. The product leaves A's normal range for norms
// beyond about 1e154 or below 1e-154 in float64 (products of paths that long value maps grow or
// shrink): then each factor's root, which stays in range. A subnormal product has lost digits
// already (norms of 1e-160 were 6e-6 off, of 1e-162 1e-2), so it counts as underflowed too.
// Elsewhere sqrt of the product, as always, so results in range keep their bits. (inf − inf and
// NaN − NaN are NaN: `p − p != 0` finds both.)
template <typename A>
C10_HOST_DEVICE inline A composite_from_parts(A l1, A linf) {
  const A product = l1 * linf;
  const bool overflowed = !(product - product == A(0));
  const bool underflowed = product < smallest_normal<A>() && l1 != A(0) && linf != A(0);
  return overflowed || underflowed ? ::sqrt(l1) * ::sqrt(linf) : ::sqrt(product);
}

// Gradient of c = sqrt(l1 · linf) pushed back onto (l1, linf). At c = 0 (a zero matrix, or the
// residual of an exactly rank-1 one) the subgradient 0 is used, so a regulariser never sees NaN.
// A zero grad_c adds nothing, also where c overflowed (0 · inf / inf would be NaN): parts that
// were computed again by the rescue (core/ops.py) get zeros there inside compiled graphs.
template <typename A>
C10_HOST_DEVICE inline void composite_backward(A l1, A linf, A c, A grad_c, A& grad_l1, A& grad_linf) {
  if (c > A(0) && grad_c != A(0)) {
    grad_l1 += grad_c * linf / (A(2) * c);
    grad_linf += grad_c * l1 / (A(2) * c);
  }
}

// d|v|/dv with the subgradient 0 at v = 0, as torch.abs uses.
template <typename A>
C10_HOST_DEVICE inline A abs_grad(A v) {
  return v > A(0) ? A(1) : (v < A(0) ? A(-1) : A(0));
}

// Layout of the `parts` output: per matrix and target, (‖·‖_1, ‖·‖_∞, ‖·‖_{1,∞}); `argmax` holds
// (column of ‖·‖_1, row of ‖·‖_∞). Target 0 is the residual (or x itself when not centred);
// target 1, present when centred with with_norm, is x itself.
constexpr int kPartL1 = 0;
constexpr int kPartLinf = 1;
constexpr int kPartComposite = 2;
constexpr int kNumParts = 3;
constexpr int kArgColumn = 0;
constexpr int kArgRow = 1;
constexpr int kNumArgs = 2;

C10_HOST_DEVICE inline int num_targets(bool centered, bool with_norm) {
  return centered && with_norm ? 2 : 1;
}

// Whether the norms of x itself are a target, and if so which.
C10_HOST_DEVICE inline bool measures_x(bool centered, bool with_norm) {
  return !centered || with_norm;
}
C10_HOST_DEVICE inline int x_target(bool centered) {
  return centered ? 1 : 0;
}

}  // namespace pathkernels

namespace pathkernels {

// What the backward pass needs of one target: the gradients reaching (‖·‖_1, ‖·‖_∞), with the
// composite's share folded in, and where the two maxima sit.
template <typename A>
struct TargetGrad {
  A col_grad = A(0);  // ∂loss/∂‖v‖_1, reaching column `col`
  A row_grad = A(0);  // ∂loss/∂‖v‖_∞, reaching row `row`
  int64_t col = 0;
  int64_t row = 0;
};

template <typename T, typename A = norm_acc_t<T>>
C10_HOST_DEVICE inline TargetGrad<A> load_target_grad(const T* grad_parts, const T* parts,
                                                      const int64_t* argmax) {
  TargetGrad<A> g;
  g.col_grad = static_cast<A>(grad_parts[kPartL1]);
  g.row_grad = static_cast<A>(grad_parts[kPartLinf]);
  composite_backward(static_cast<A>(parts[kPartL1]), static_cast<A>(parts[kPartLinf]),
                     static_cast<A>(parts[kPartComposite]), static_cast<A>(grad_parts[kPartComposite]),
                     g.col_grad, g.row_grad);
  g.col = argmax[kArgColumn];
  g.row = argmax[kArgRow];
  return g;
}

// ∂(‖v‖_1, ‖v‖_∞)/∂v_ij: the sign of v_ij on the maximal column and on the maximal row.
template <typename A>
C10_HOST_DEVICE inline A target_grad_element(const TargetGrad<A>& g, int64_t i, int64_t j, A v) {
  const A scale = (j == g.col ? g.col_grad : A(0)) + (i == g.row ? g.row_grad : A(0));
  return scale == A(0) ? A(0) : abs_grad(v) * scale;
}

// Column mean over the n rows of the (sparse) gradient above, at column j. The residual's
// gradient is centred by it, because ∂(x − 1μᵀ)/∂x is the centring map C. `v_on_row` is v at
// (g.row, j); `col_sign_sum` is Σ_i sign(v_i,g.col).
template <typename A>
C10_HOST_DEVICE inline A target_grad_column_mean(const TargetGrad<A>& g, int64_t j, A v_on_row, A col_sign_sum,
                                                 int64_t rows) {
  const A on_column = j == g.col ? g.col_grad * col_sign_sum : A(0);
  return (g.row_grad * abs_grad(v_on_row) + on_column) / static_cast<A>(rows);
}

}  // namespace pathkernels
