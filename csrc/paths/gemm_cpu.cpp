// The CPU engine's GEMM (gemm_cpu.h): register tiles of kRows × kVecs vectors over a packed panel
// of B, written once with GCC vector extensions and compiled for AVX-512 and for AVX2 + FMA by the
// target attributes of their entry points (the inline templates take the caller's target), with a
// portable loop for every other CPU. The op `_engine_mm` exposes it to the tests.
#include "paths/gemm_cpu.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/checks.h"

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#include <immintrin.h>
#define PATHKERNELS_GEMM_X86 1
#define PATHKERNELS_GEMM_INLINE inline __attribute__((always_inline))
#else
#define PATHKERNELS_GEMM_X86 0
#define PATHKERNELS_GEMM_INLINE inline
#endif

namespace pathkernels::cpu {
namespace {

// The portable kernel: row i of C accumulates in `row` (cols), term by term, so that the compiler
// may vectorise over j without changing any element's chain. kFused: std::fma per term, the rule
// of the vector kernels; otherwise a multiply and an add (CPUs without FMA).
template <typename T, bool kFused>
void gemm_portable(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb,
                   T* c, int64_t ldc, bool accumulate) {
  std::vector<T> row(static_cast<size_t>(cols));
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(row.begin(), row.end(), T(0));
    for (int64_t k = 0; k < depth; ++k) {
      const T s = a[i * lda + k];
      const T* bk = b + k * ldb;
      for (int64_t j = 0; j < cols; ++j) {
        if constexpr (kFused) {
          row[j] = std::fma(s, bk[j], row[j]);
        } else {
          row[j] = s * bk[j] + row[j];
        }
      }
    }
    T* ci = c + i * ldc;
    for (int64_t j = 0; j < cols; ++j) {
      ci[j] = accumulate ? row[j] + ci[j] : row[j];
    }
  }
}

// dot's rule (gemm_cpu.h), written once: eight lanes of chains, a fixed tree at the end. The
// x86 entry points below compile it for their targets, where the lanes become one or two vectors.
template <typename T, bool kFused>
PATHKERNELS_GEMM_INLINE T dot_lanes(int64_t n, const T* x, const T* y) {
  T lane[8] = {};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int l = 0; l < 8; ++l) {
      lane[l] = kFused ? std::fma(x[k + l], y[k + l], lane[l]) : x[k + l] * y[k + l] + lane[l];
    }
  }
  for (int l = 0; k + l < n; ++l) {
    lane[l] = kFused ? std::fma(x[k + l], y[k + l], lane[l]) : x[k + l] * y[k + l] + lane[l];
  }
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

#if PATHKERNELS_GEMM_X86

template <typename T, int kBytes>
struct VectorOf {
  typedef T type __attribute__((vector_size(kBytes)));
};

// s · b + c with one rounding per lane (std::fma's rule), one FMA instruction per vector: the
// tiles' and the row kernel's every multiply-add. Written out, not left to the compiler's
// contraction of `s * b + c`, which GCC versions apply differently: GCC 13 left some products of
// the tiles unfused where GCC 12 fused them all, and an element's bits then depended on the tile
// that computed it. (The extension is built with -ffp-contract=off.) Each overload carries its
// target, so the templates that call it are compiled only inside gemm_avx512 and gemm_avx2, whose
// `flatten` inlines the whole call tree there.
using Float16 = VectorOf<float, 64>::type;
using Double8 = VectorOf<double, 64>::type;
using Float8 = VectorOf<float, 32>::type;
using Double4 = VectorOf<double, 32>::type;
__attribute__((target("avx512f,fma"))) inline Float16 fma_lanes(float s, Float16 b, Float16 c) {
  return _mm512_fmadd_ps(_mm512_set1_ps(s), b, c);
}
__attribute__((target("avx512f,fma"))) inline Double8 fma_lanes(double s, Double8 b, Double8 c) {
  return _mm512_fmadd_pd(_mm512_set1_pd(s), b, c);
}
__attribute__((target("avx2,fma"))) inline Float8 fma_lanes(float s, Float8 b, Float8 c) {
  return _mm256_fmadd_ps(_mm256_set1_ps(s), b, c);
}
__attribute__((target("avx2,fma"))) inline Double4 fma_lanes(double s, Double4 b, Double4 c) {
  return _mm256_fmadd_pd(_mm256_set1_pd(s), b, c);
}

// One tile: rows i..i+kRows−1 of C over a panel of kWidth = kVecs · lanes columns, `cols` of them
// real. The kRows × kVecs accumulators stay in registers for the whole depth; row r's scalar
// A[r, k] (a[r · lda + k], or a[k · kRows + r] when kPackedA: pack_a) is broadcast against the
// panel's row k. Before the products, the tile's lines of C are prefetched.
// b: the panel's rows, ldb apart (the packed panel, or B itself when its panel is whole). With
// `pack` (a whole panel read from B itself), each row of the panel is also written there, kWidth
// apart, for the tiles below to read from cache, and the next panel's part of the row is requested:
// packing costs no pass of its own.
template <typename T, int kBytes, int kRows, int kVecs, bool kPackedA>
PATHKERNELS_GEMM_INLINE void tile(int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                                  int64_t ldc, int64_t cols, bool accumulate, T* pack = nullptr) {
  using V = typename VectorOf<T, kBytes>::type;
  constexpr int64_t kLanes = kBytes / sizeof(T);
  constexpr int64_t kWidth = kLanes * kVecs;
  V acc[kRows][kVecs];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      acc[r][v] = V{};
    }
    // The tile's lines of C, requested now: their reads for ownership (C's rows lie a level apart
    // in the engine) then overlap the products instead of holding up the stores. (Without the
    // prfchw target this is a read prefetch; prefetchw measured 5–10 % slower in float32.)
    for (int64_t line = 0; line < kWidth * static_cast<int64_t>(sizeof(T)); line += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(c + r * ldc) + line, 1);
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    V bk[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      std::memcpy(&bk[v], b + k * ldb + v * kLanes, sizeof(V));
    }
    if (pack != nullptr) {
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        std::memcpy(pack + k * kWidth + v * kLanes, &bk[v], sizeof(V));
      }
      // The next panel's part of this row: depth rows far apart are more streams than the hardware
      // prefetchers follow.
      for (int64_t line = 0; line < kWidth * static_cast<int64_t>(sizeof(T)); line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(b + k * ldb + kWidth) + line);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const T s = kPackedA ? a[k * kRows + r] : a[r * lda + k];
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        acc[r][v] = fma_lanes(s, bk[v], acc[r][v]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    T* cr = c + r * ldc;
    if (cols == kWidth) {
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        V out = acc[r][v];
        if (accumulate) {
          V old;
          std::memcpy(&old, cr + v * kLanes, sizeof(V));
          out = out + old;
        }
        std::memcpy(cr + v * kLanes, &out, sizeof(V));
      }
    } else {
      T out[kWidth];
      std::memcpy(out, acc[r], sizeof out);
      for (int64_t j = 0; j < cols; ++j) {
        cr[j] = accumulate ? out[j] + cr[j] : out[j];
      }
    }
  }
}

// The last rows_left < kRows rows of a panel, with a tile of exactly that many rows.
template <typename T, int kBytes, int kRows, int kVecs, bool kPackedA>
PATHKERNELS_GEMM_INLINE void row_tail(int64_t rows_left, int64_t depth, const T* a, int64_t lda, const T* b,
                                      int64_t ldb, T* c, int64_t ldc, int64_t cols, bool accumulate) {
  if constexpr (kRows > 0) {
    if (rows_left == kRows) {
      tile<T, kBytes, kRows, kVecs, kPackedA>(depth, a, lda, b, ldb, c, ldc, cols, accumulate);
    } else {
      row_tail<T, kBytes, kRows - 1, kVecs, kPackedA>(rows_left, depth, a, lda, b, ldb, c, ldc, cols, accumulate);
    }
  }
}

// A thread's scratch of `count` elements on a 64-byte boundary, so that no vector load of a packed
// panel straddles two cache lines (std::vector aligns to 16 bytes only).
template <typename T>
T* aligned_scratch(std::vector<T>& storage, int64_t count) {
  constexpr size_t kSlack = 64 / sizeof(T);
  storage.resize(static_cast<size_t>(count) + kSlack);
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return storage.data() + ((64 - address % 64) % 64) / sizeof(T);
}

// One panel of C: columns j..j+width−1 of every row, width ≤ kVecs · lanes. A panel that several
// row tiles read is packed into a contiguous buffer (B's rows lie a level apart in the engine, which
// costs TLB and cache-set misses on every tile): a whole one by its first row tile, as it reads it;
// a partial one first, with zeros beyond its columns, which no lane stores.
template <typename T, int kBytes, int kRows, int kVecs, bool kPackedA>
PATHKERNELS_GEMM_INLINE void gemm_panel(int64_t rows, int64_t width, int64_t depth, const T* a, int64_t lda,
                                        const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  // Row tile i's A: at a + i · depth when packed (pack_a), else at a + i · lda.
  const int64_t a_step = kPackedA ? depth : lda;
  constexpr int64_t kWidth = static_cast<int64_t>(kBytes / sizeof(T)) * kVecs;
  thread_local std::vector<T> packed;
  const T* panel = b;
  int64_t panel_ld = ldb;
  int64_t i = 0;
  if (width == kWidth && rows > kRows) {
    T* scratch = aligned_scratch(packed, depth * kWidth);
    tile<T, kBytes, kRows, kVecs, kPackedA>(depth, a, lda, b, ldb, c, ldc, width, accumulate, scratch);
    i = kRows;
    panel = scratch;
    panel_ld = kWidth;
  } else if (width < kWidth) {
    T* scratch = aligned_scratch(packed, depth * kWidth);
    for (int64_t k = 0; k < depth; ++k) {
      T* dst = scratch + k * kWidth;
      const T* src = b + k * ldb;
      std::memcpy(dst, src, width * sizeof(T));
      std::fill(dst + width, dst + kWidth, T(0));
    }
    panel = scratch;
    panel_ld = kWidth;
  }
  for (; i + kRows <= rows; i += kRows) {
    tile<T, kBytes, kRows, kVecs, kPackedA>(depth, a + i * a_step, lda, panel, panel_ld, c + i * ldc, ldc, width,
                                            accumulate);
  }
  row_tail<T, kBytes, kRows - 1, kVecs, kPackedA>(rows - i, depth, a + i * a_step, lda, panel, panel_ld, c + i * ldc,
                                                  ldc, width, accumulate);
}

// The last columns of C, fewer than kVecs vectors' worth, in a panel of just enough vectors.
template <typename T, int kBytes, int kRows, int kVecs, bool kPackedA>
PATHKERNELS_GEMM_INLINE void last_panel(int64_t rows, int64_t width, int64_t depth, const T* a, int64_t lda,
                                        const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kLanes = kBytes / sizeof(T);
  if constexpr (kVecs > 0) {
    if (width > (kVecs - 1) * kLanes) {
      gemm_panel<T, kBytes, kRows, kVecs, kPackedA>(rows, width, depth, a, lda, b, ldb, c, ldc, accumulate);
    } else {
      last_panel<T, kBytes, kRows, kVecs - 1, kPackedA>(rows, width, depth, a, lda, b, ldb, c, ldc, accumulate);
    }
  }
}

// A packed for the row tiles (tiles of kRows rows, the last one shorter), each tile's terms
// k-major: row r, term k of the tile at row i lies at buffer[i · depth + k · height + r], height the
// tile's rows. A term's scalars then share one cache line, A streams in order once per panel, and
// a tile addresses it from one pointer.
template <typename T, int kRows>
const T* pack_a(int64_t rows, int64_t depth, const T* a, int64_t lda, std::vector<T>& buffer) {
  T* packed = aligned_scratch(buffer, rows * depth);
  for (int64_t i = 0; i < rows; i += kRows) {
    const int64_t height = std::min<int64_t>(kRows, rows - i);
    T* dst = packed + i * depth;
    for (int64_t k = 0; k < depth; ++k) {
      for (int64_t r = 0; r < height; ++r) {
        dst[k * height + r] = a[(i + r) * lda + k];
      }
    }
  }
  return packed;
}

// C by panels of kVecs vectors, then the remaining columns in a panel of fewer (narrow products,
// such as the value maps' d_head columns, would waste most of a full panel).
template <typename T, int kBytes, int kRows, int kVecs, bool kPackedA>
PATHKERNELS_GEMM_INLINE void panels(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda, const T* b,
                                    int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kWidth = static_cast<int64_t>(kBytes / sizeof(T)) * kVecs;
  int64_t j = 0;
  for (; j + kWidth <= cols; j += kWidth) {
    gemm_panel<T, kBytes, kRows, kVecs, kPackedA>(rows, kWidth, depth, a, lda, b + j, ldb, c + j, ldc, accumulate);
  }
  if (j < cols) {
    last_panel<T, kBytes, kRows, kVecs, kPackedA>(rows, cols - j, depth, a, lda, b + j, ldb, c + j, ldc, accumulate);
  }
}

// With several panels A is packed first (pack_a); a single panel reads A once, where it lies.
template <typename T, int kBytes, int kRows, int kVecs>
PATHKERNELS_GEMM_INLINE void gemm_panels(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda,
                                         const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kWidth = static_cast<int64_t>(kBytes / sizeof(T)) * kVecs;
  if (cols > kWidth) {
    thread_local std::vector<T> packed_a;
    const T* packed = pack_a<T, kRows>(rows, depth, a, lda, packed_a);
    panels<T, kBytes, kRows, kVecs, true>(rows, cols, depth, packed, lda, b, ldb, c, ldc, accumulate);
  } else {
    panels<T, kBytes, kRows, kVecs, false>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  }
}

// A product of one row (the column means' aᵀR) reads each element of B once, so it streams B's
// rows: a chunk of the row's columns accumulates in L1, term by term in k, each element still one
// chain. (Register tiles over panels read n rows of B at once and stalled the prefetchers.)
template <typename T, int kBytes>
PATHKERNELS_GEMM_INLINE void gemm_row(int64_t cols, int64_t depth, const T* a, const T* b, int64_t ldb, T* c,
                                      bool accumulate) {
  using V = typename VectorOf<T, kBytes>::type;
  constexpr int64_t kLanes = kBytes / sizeof(T);
  constexpr int64_t kChunk = 2048 / sizeof(T);
  alignas(64) T acc[kChunk];
  for (int64_t j = 0; j < cols; j += kChunk) {
    const int64_t width = std::min(kChunk, cols - j);
    const int64_t vectors = width / kLanes;
    std::fill(acc, acc + width, T(0));
    // Four rows of B per pass over the chunk: a vector's chain stays in a register for four terms.
    int64_t k = 0;
    for (; k + 4 <= depth; k += 4) {
      const T* bk = b + k * ldb + j;
      for (int64_t v = 0; v < vectors; ++v) {
        V x0, x1, x2, x3, sum;
        std::memcpy(&x0, bk + v * kLanes, sizeof(V));
        std::memcpy(&x1, bk + ldb + v * kLanes, sizeof(V));
        std::memcpy(&x2, bk + 2 * ldb + v * kLanes, sizeof(V));
        std::memcpy(&x3, bk + 3 * ldb + v * kLanes, sizeof(V));
        std::memcpy(&sum, acc + v * kLanes, sizeof(V));
        sum = fma_lanes(a[k], x0, sum);
        sum = fma_lanes(a[k + 1], x1, sum);
        sum = fma_lanes(a[k + 2], x2, sum);
        sum = fma_lanes(a[k + 3], x3, sum);
        std::memcpy(acc + v * kLanes, &sum, sizeof(V));
      }
      for (int64_t jj = vectors * kLanes; jj < width; ++jj) {
        for (int64_t kk = k; kk < k + 4; ++kk) {
          acc[jj] = std::fma(a[kk], b[kk * ldb + j + jj], acc[jj]);
        }
      }
    }
    for (; k < depth; ++k) {
      const T s = a[k];
      const T* bk = b + k * ldb + j;
      for (int64_t v = 0; v < vectors; ++v) {
        V x, sum;
        std::memcpy(&x, bk + v * kLanes, sizeof(V));
        std::memcpy(&sum, acc + v * kLanes, sizeof(V));
        sum = fma_lanes(s, x, sum);
        std::memcpy(acc + v * kLanes, &sum, sizeof(V));
      }
      for (int64_t jj = vectors * kLanes; jj < width; ++jj) {
        acc[jj] = std::fma(s, bk[jj], acc[jj]);
      }
    }
    for (int64_t jj = 0; jj < width; ++jj) {
      c[j + jj] = accumulate ? acc[jj] + c[j + jj] : acc[jj];
    }
  }
}

template <typename T, int kBytes, int kRows, int kVecs>
PATHKERNELS_GEMM_INLINE void gemm_tiles(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda,
                                        const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  if (rows == 1) {
    gemm_row<T, kBytes>(cols, depth, a, b, ldb, c, accumulate);
  } else {
    gemm_panels<T, kBytes, kRows, kVecs>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  }
}

// Tiles of 24 vectors of 64 bytes, 24 of the 32 registers accumulating: 8 rows × 3 vectors for
// float, 6 rows × 4 vectors for double, whose 32-column panels the engine's n = 64 and 128 split
// evenly and whose fewer broadcasts per product ran the engine 4–5 % faster at n = 64 (8 × 3 left
// a 16-column panel per 64).
template <typename T>
__attribute__((target("avx512f,fma"), flatten)) void gemm_avx512(int64_t rows, int64_t cols, int64_t depth, const T* a,
                                                          int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
                                                          bool accumulate) {
  if constexpr (std::is_same_v<T, double>) {
    gemm_tiles<T, 64, 6, 4>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  } else {
    gemm_tiles<T, 64, 8, 3>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  }
}

// Tiles of 4 rows × up to 3 vectors of 32 bytes: 12 of the 16 registers accumulate.
template <typename T>
__attribute__((target("avx2,fma"), flatten)) void gemm_avx2(int64_t rows, int64_t cols, int64_t depth, const T* a,
                                                    int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc,
                                                    bool accumulate) {
  gemm_tiles<T, 32, 4, 3>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
}

template <typename T>
__attribute__((target("avx512f,fma"), flatten)) T dot_avx512(int64_t n, const T* x, const T* y) {
  return dot_lanes<T, true>(n, x, y);
}

template <typename T>
__attribute__((target("avx2,fma"), flatten)) T dot_avx2(int64_t n, const T* x, const T* y) {
  return dot_lanes<T, true>(n, x, y);
}

bool cpu_has(GemmIsa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case GemmIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
    case GemmIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    default:
      return true;
  }
}

bool cpu_has_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("fma");
}

#else

bool cpu_has(GemmIsa isa) {
  return isa == GemmIsa::kAuto || isa == GemmIsa::kPortable;
}

bool cpu_has_fma() {
  return true;  // std::fma: the hardware's on every other CPU this builds for (aarch64, ppc64le, s390x)
}

#endif

}  // namespace

GemmIsa widest_isa() {
  static const GemmIsa isa = cpu_has(GemmIsa::kAvx512) ? GemmIsa::kAvx512
                             : cpu_has(GemmIsa::kAvx2) ? GemmIsa::kAvx2
                                                       : GemmIsa::kPortable;
  return isa;
}

GemmIsa parse_gemm_isa(c10::string_view name, const char* op) {
  GemmIsa isa;
  if (name == "auto") {
    isa = GemmIsa::kAuto;
  } else if (name == "avx512") {
    isa = GemmIsa::kAvx512;
  } else if (name == "avx2") {
    isa = GemmIsa::kAvx2;
  } else if (name == "portable") {
    isa = GemmIsa::kPortable;
  } else {
    TORCH_CHECK_VALUE(false, op, ": expected isa in ('auto', 'avx512', 'avx2', 'portable'), got '", std::string(name),
                      "'");
  }
  TORCH_CHECK_VALUE(cpu_has(isa), op, ": isa='", std::string(name), "' is not available on this CPU or build");
  return isa;
}

template <typename T>
void gemm(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
          int64_t ldc, bool accumulate, GemmIsa isa) {
  if (rows == 0 || cols == 0) {
    return;
  }
  if (isa == GemmIsa::kAuto) {
    isa = widest_isa();
  }
#if PATHKERNELS_GEMM_X86
  if (isa == GemmIsa::kAvx512) {
    gemm_avx512<T>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
    return;
  }
  if (isa == GemmIsa::kAvx2) {
    gemm_avx2<T>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
    return;
  }
#endif
  static const bool fused = cpu_has_fma();
  if (fused) {
    gemm_portable<T, true>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  } else {
    gemm_portable<T, false>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
  }
}

template <typename T>
T dot(int64_t n, const T* x, const T* y, GemmIsa isa) {
  if (isa == GemmIsa::kAuto) {
    isa = widest_isa();
  }
#if PATHKERNELS_GEMM_X86
  if (isa == GemmIsa::kAvx512) {
    return dot_avx512<T>(n, x, y);
  }
  if (isa == GemmIsa::kAvx2) {
    return dot_avx2<T>(n, x, y);
  }
#endif
  static const bool fused = cpu_has_fma();
  return fused ? dot_lanes<T, true>(n, x, y) : dot_lanes<T, false>(n, x, y);
}

template float dot<float>(int64_t, const float*, const float*, GemmIsa);
template double dot<double>(int64_t, const double*, const double*, GemmIsa);

template void gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t,
                          bool, GemmIsa);
template void gemm<double>(int64_t, int64_t, int64_t, const double*, int64_t, const double*, int64_t, double*,
                           int64_t, bool, GemmIsa);

void mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate, GemmIsa isa) {
  constexpr const char* op = "pathkernels._engine_mm";
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
                        out.size(0) == a.size(0) && out.size(1) == b.size(1),
                    op, ": expected a [r, k], b [k, c] and out [r, c], got ", shape_string(a.sizes()), ", ",
                    shape_string(b.sizes()), " and ", shape_string(out.sizes()));
  TORCH_CHECK_TYPE((a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble) &&
                       b.scalar_type() == a.scalar_type() && out.scalar_type() == a.scalar_type(),
                   op, ": expected a, b and out in one dtype, float32 or float64, got ", dtype_name(a.scalar_type()),
                   ", ", dtype_name(b.scalar_type()), " and ", dtype_name(out.scalar_type()));
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu(), op,
                    ": expected CPU tensors");
  TORCH_INTERNAL_ASSERT(out.size(1) <= 1 || out.stride(1) == 1, op, ": out needs a unit column stride");
  const at::Tensor a_rows = a.size(1) <= 1 || a.stride(1) == 1 ? a : a.contiguous();
  const at::Tensor b_rows = b.size(1) <= 1 || b.stride(1) == 1 ? b : b.contiguous();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "_engine_mm", [&] {
    gemm<scalar_t>(out.size(0), out.size(1), a.size(1), a_rows.const_data_ptr<scalar_t>(), a_rows.stride(0),
                   b_rows.const_data_ptr<scalar_t>(), b_rows.stride(0), out.mutable_data_ptr<scalar_t>(),
                   out.stride(0), accumulate, isa);
  });
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b, GemmIsa isa) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  mm_out(out, a, b, false, isa);
  return out;
}

namespace {

at::Tensor engine_mm_op(const at::Tensor& a, const at::Tensor& b, c10::string_view isa) {
  return mm(a, b, parse_gemm_isa(isa, "pathkernels._engine_mm"));
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("_engine_mm", &engine_mm_op);
}

}  // namespace pathkernels::cpu
