// The float32 range rule of the path-tree engine (engine.h, docs/DESIGN.md §3), as host and device
// functions: the CPU backend's loops (paths_cpu.cpp) and the CUDA backend's kernels (paths_cuda.cu)
// apply the very same rule.
//
// A node R' whose largest |R'| is finite, nonzero and outside [2^-32, 2^32] is divided by 2^e, e its
// frexp exponent (clamped so that 2^±e stays a normal float32), and its scale is multiplied by
// 2^e. Both are exact.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace pathkernels::scales {

constexpr double kRenormaliseBelow = 0x1p-32;
constexpr double kRenormaliseAbove = 0x1p32;
constexpr int kMaxRenormaliseExponent = 120;

// The bits of |v| as an unsigned integer: ordered as |v| is, with every NaN above inf. Integer
// maxima vectorise (CPU) and shuffle (CUDA) where floating-point ones, with their NaN rules, do not.
template <typename T>
using MagnitudeBits = std::conditional_t<sizeof(T) == 4, uint32_t, unsigned long long>;
static_assert(sizeof(MagnitudeBits<double>) == sizeof(double), "64-bit magnitude bits");

template <typename T>
C10_HOST_DEVICE inline MagnitudeBits<T> magnitude_bits(T v) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "float32 or float64");
  MagnitudeBits<T> bits;
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    bits = __float_as_uint(v);
  } else {
    bits = static_cast<MagnitudeBits<T>>(__double_as_longlong(v));
  }
#else
  std::memcpy(&bits, &v, sizeof(bits));
#endif
  return bits & ~(MagnitudeBits<T>(1) << (8 * sizeof(T) - 1));
}

template <typename T>
C10_HOST_DEVICE inline T from_magnitude_bits(MagnitudeBits<T> bits) {
  T v;
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    v = __uint_as_float(bits);
  } else {
    v = __longlong_as_double(static_cast<long long>(bits));
  }
#else
  std::memcpy(&v, &bits, sizeof(v));
#endif
  return v;
}

// The exponent e by which the rule renormalises a node whose largest |R'| is `largest` (exact in
// double for float32 nodes); 0 leaves the node alone (as one holding NaN or inf is).
C10_HOST_DEVICE inline int renormalise_exponent(double largest) {
  const bool finite_positive = largest > 0.0 && largest <= std::numeric_limits<double>::max();  // NaN fails both
  if (!finite_positive || (largest >= kRenormaliseBelow && largest <= kRenormaliseAbove)) {
    return 0;
  }
  int e = 0;
  ::frexp(largest, &e);
  return e < -kMaxRenormaliseExponent ? -kMaxRenormaliseExponent : e > kMaxRenormaliseExponent ? kMaxRenormaliseExponent : e;
}

}  // namespace pathkernels::scales
