// Every op schema of torch.ops.pathkernels, and the pybind11 module shell. Backends register
// their kernels in their own files (TORCH_LIBRARY_IMPL); no tensor crosses pybind11.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

TORCH_LIBRARY(pathkernels, m) {
  // x [..., n, m] -> parts [..., T, 3] = (‖v‖_1, ‖v‖_∞, ‖v‖_{1,∞}) and argmax [..., T, 2] =
  // (column of ‖v‖_1, row of ‖v‖_∞), one fused pass. centered: v = x − 1·meanᵀ, then (with_norm,
  // T = 2) v = x; without with_norm T = 1 and x's own sums are skipped. Not centered: T = 1, v = x.
  m.def("norm_parts(Tensor x, bool centered, bool with_norm=True) -> (Tensor parts, Tensor argmax)");
  m.def(
      "norm_parts_backward(Tensor grad_parts, Tensor x, Tensor parts, Tensor argmax, bool centered, "
      "bool with_norm=True) -> Tensor");
  // One chunk of a path tree, breadth-first (docs/DESIGN.md §3): attn [B, L, H, n, n] centred C(A), attn_mean
  // [B, L, H, n] = 1ᵀA/n, root [B, n, m] = C(X) (or C(I)), root_mean [B, m], optional factored
  // w_v [L, H, d, d_head] and w_o [L, H, d_head, d]; level l's nodes sorted by head with their parent
  // positions. Returns per leaf (last level) ‖R‖_{1,∞} and ‖1μᵀ + R‖_{1,∞}, each [B, N_L] in float64
  // (float32 trees carry power-of-two scales so that tiny residuals keep their digits; engine.h).
  // leaf_kernel: how CUDA reduces leaves of n <= 128 rows: "simt" (the fused leaf kernel, no leaf
  // is stored), "tf32x3" or "tf32" (the same on tensor cores, float32 only: float32 accuracy, or
  // one TF32 pass), "gemm" (cuBLAS into a scratch block, then a reduction), "heads_" and a variant of
  // _heads_leaf_norms (leaf levels whose every head takes the same parents in one call of that
  // kernel, other leaf blocks through "tf32x3" or "tf32"). The CPU ignores it but for "heads_*",
  // which it runs through the heads kernel's CPU harness (for the tests: slow). all_heads_levels:
  // internal levels whose every head takes the same parents in a fixed number of launches whatever
  // H (one batched product, one GEMM of the means, one pass of the scales; engine.h), else per head.
  m.def(
      "path_chunk_norms(Tensor attn, Tensor attn_mean, Tensor root, Tensor root_mean, Tensor? w_v, "
      "Tensor? w_o, Tensor[] parents, Tensor[] heads, int leaf_block, str leaf_kernel=\"simt\", "
      "bool all_heads_levels=False) -> (Tensor residual, Tensor norm)");
  // The fused leaf reduction on its own: attn C(A) [n, n] (n <= 128), right [n, c, m],
  // mean [c, m], optional scale [c] (float64 powers of two, default 1) -> per leaf k, with
  // R_k = scale_k · C(A) right_k, ‖R_k‖_{1,∞} and ‖1 mean_kᵀ + R_k‖_{1,∞}, each [c] in float64.
  // kernel: "simt", "tf32x3" or "tf32" (as path_chunk_norms' leaf_kernel). The CUDA kernel computes
  // each leaf on chip and never stores it; the CPU kernel runs the same per-thread code thread by
  // thread, the mma emulated (a test harness, not a fast path).
  m.def(
      "_fused_leaf_norms(Tensor attn, Tensor right, Tensor mean, Tensor? scale=None, str kernel=\"simt\") "
      "-> (Tensor residual, Tensor norm)");
  // The leaves of a block of parents under every head at once (csrc/paths/heads_leaf.h): attn C(A_h)
  // [H, n, n] (n <= 128), attn_mean a_h [H, n], right R'_k [n, c, m], mean μ_k [c, m], optional scale
  // [c] (float64, default 1), all float32 -> per parent k and head h, with R = scale_k · C(A_h) R'_k
  // and μ = μ_k + scale_k R'_kᵀ a_h, ‖R‖_{1,∞} and ‖1μᵀ + R‖_{1,∞}, each [c, H] in float64. kernel:
  // "tf32x3", "tf32x3_128" (3×TF32, 64- or 128-column tiles), "tf32", "tf32_128" (one TF32 pass).
  // The CPU kernel is the CUDA kernel's per-thread code run thread by thread (a test harness).
  m.def(
      "_heads_leaf_norms(Tensor attn, Tensor attn_mean, Tensor right, Tensor mean, Tensor? scale=None, "
      "str kernel=\"tf32x3\") -> (Tensor residual, Tensor norm)");
  // The CPU engine's GEMM on its own (csrc/paths/gemm_cpu.h), for the tests: a [r, k] @ b [k, c],
  // each element one chain of fused multiply-adds over k, whatever the shapes. isa: "auto",
  // "avx512", "avx2" or "portable" (the kernels must agree bit for bit).
  m.def("_engine_mm(Tensor a, Tensor b, str isa=\"auto\") -> Tensor");
  // pk.path_statistics' fold of one chunk of per-leaf results into its accumulators, in place
  // (CPU; csrc/paths/statistics_cpu.cpp documents the arguments). Other devices use torch ops.
  m.def(
      "_statistics_update(Tensor residual, Tensor norm, Tensor lengths, Tensor edges, Tensor(a!) counts, "
      "Tensor(b!) log10_ratio_sums, Tensor(c!) sums, Tensor(d!) sums_of_squares, Tensor(e!) minima, "
      "Tensor(f!) maxima, Tensor(g!) argmin, Tensor(h!) argmax, Tensor(i!) histograms) -> ()");
  // The readout engine (csrc/readout/readout.h): one step of the top-down readout trie,
  // float64. rho [N, P, n] and phi [N, R, d] per node; values [N, P, R] = rho_i K phi_iᵀ through the
  // source K [n, d]; the children through each head h, rho_i T_h [H, N, P, n] and phi_i F_in[h] F_out[h]
  // [H, N, R, d'] (F_in [H, d, e], F_out [H, e, d'] or none: phi_i F_in[h], d' = e). CPU: the engine's
  // GEMM, the same bits however the nodes are batched.
  m.def("_readout_values(Tensor rho, Tensor phi, Tensor source) -> Tensor");
  m.def(
      "_readout_heads(Tensor rho, Tensor phi, Tensor token_maps, Tensor feature_in, Tensor? feature_out=None) "
      "-> (Tensor rho_heads, Tensor phi_heads)");
}

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch_version"] = std::string(PATHKERNELS_TORCH_VERSION);
#ifdef PATHKERNELS_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = std::string(PATHKERNELS_CUDA_VERSION);
  info["cuda_architectures"] = std::string(PATHKERNELS_CUDA_ARCHS);
#else
  info["cuda"] = false;
  info["cuda_version"] = pybind11::none();
  info["cuda_architectures"] = std::string();
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pathkernels compiled extension: ops register with torch.ops.pathkernels on import";
  m.def("build_info", &build_info,
        "The torch version this binary was built against, whether CUDA kernels are built, the CUDA "
        "version and the CUDA architectures.");
}
