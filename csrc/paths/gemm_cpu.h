// The CPU engine's matrix products: a small GEMM whose every element is computed the same way
// whatever the shape of the call, the element's place in it, the thread that runs it or the memory
// budget that sized it (docs/DESIGN.md §3, Reproducibility).
//
// A BLAS gives the same bits only for the same call: MKL's AVX2 kernels, for one, round a column
// differently when the number of columns, the column's offset or the thread count changes. The
// engine's calls are shaped by its chunks and leaf blocks, which follow the budget and the threads,
// so it computes its products here instead, with one rule per element:
//
//     C[i, j] = ((0 + A[i, 0]·B[0, j]) + A[i, 1]·B[1, j]) + … + A[i, K−1]·B[K−1, j]
//
// one fused multiply-add per term in that order (a multiply and an add on CPUs without FMA), then
// `+ C[i, j]` once when accumulating. Each vector lane carries one element through that chain, so
// the vector width changes nothing: the AVX-512, AVX2 and portable kernels give the same bits on a
// CPU with FMA (tests/test_engine_gemm.py compares them).
#pragma once

#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <cstdint>

namespace pathkernels::cpu {

// Which kernel runs a product: kAuto picks the widest one the CPU runs; the others are for tests.
enum class GemmIsa { kAuto, kAvx512, kAvx2, kPortable };

// "auto", "avx512", "avx2" or "portable"; refuses other names and kernels this CPU (or build)
// cannot run, naming `op` in the error.
GemmIsa parse_gemm_isa(c10::string_view name, const char* op);

// The widest kernel this CPU and build run (what kAuto picks): kAvx512, kAvx2 or kPortable.
GemmIsa widest_isa();

// C = A·B, or C = A·B + C with accumulate, by the rule above. A [rows, depth], B [depth, cols] and
// C [rows, cols] are row-major with unit column stride and the given row strides; C must not
// overlap A or B. Runs on the calling thread.
template <typename T>
void gemm(int64_t rows, int64_t cols, int64_t depth, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
          int64_t ldc, bool accumulate, GemmIsa isa = GemmIsa::kAuto);

// Σ_k x[k]·y[k] by a rule that depends on n alone: eight chains of fused multiply-adds, chain l
// over k ≡ l (mod 8) in increasing k, then ((c0 + c4) + (c1 + c5)) + ((c2 + c6) + (c3 + c7)).
// The same bits from every kernel on a CPU with FMA, as gemm's.
template <typename T>
T dot(int64_t n, const T* x, const T* y, GemmIsa isa = GemmIsa::kAuto);

// out [r, c] = a [r, k] @ b [k, c] (+ out with accumulate): CPU tensors of one floating dtype
// (float32 or float64); out has a unit column stride, a and b are made so where they are not.
void mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate = false,
            GemmIsa isa = GemmIsa::kAuto);

// a @ b in a new contiguous tensor.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b, GemmIsa isa = GemmIsa::kAuto);

}  // namespace pathkernels::cpu
