// The readout engine: one step of the top-down readout trie of a frozen transformer, in
// float64 (docs/DESIGN.md, "Real transformers"). A node of the trie has chosen a branch of every
// sublayer above some source; it holds rho [P, n], rᵀ times the token maps chosen (one row per
// read-out position), and phi [R, d], the feature maps chosen applied to each readout direction.
//
//   _readout_values: a node's attribution through source K [n, d]: rho K phiᵀ, [P, R] per node;
//   _readout_heads:  its children through each head h of the sublayer below, rho T_h and
//                    phi F_in[h] F_out[h] (the feature map factored through d_head), or phi F_in[h]
//                    alone (path_attribution keeps a pre-norm phi in a head's d_head coordinates).
//
// The CPU kernels (readout_cpu.cpp) compute every product with the engine's GEMM and dot
// (paths/gemm_cpu.h), whose elements do not depend on how the nodes are batched: path_attribution's
// depth-first chunks and top_paths' best-first batches give the same bits. Other devices run the
// ATen form in readout.cpp (cuBLAS on CUDA).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace pathkernels::readout {

// Shapes, dtype (float64) and device of _readout_values' inputs; returns {N, P, R, n, d}.
struct ValuesShape {
  int64_t nodes, positions, readouts, tokens, features;
};
ValuesShape check_values(const at::Tensor& rho, const at::Tensor& phi, const at::Tensor& source);

// The same for _readout_heads; returns {N, P, R, n, d, H, e, d'} (d' = e without feature_out).
struct HeadsShape {
  int64_t nodes, positions, readouts, tokens, features, heads, head_dim, out_features;
};
HeadsShape check_heads(const at::Tensor& rho, const at::Tensor& phi, const at::Tensor& token_maps,
                       const at::Tensor& feature_in, const std::optional<at::Tensor>& feature_out);

}  // namespace pathkernels::readout
