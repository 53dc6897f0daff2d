#include "paths/paths.h"

#include <string>
#include <type_traits>

#include "common/checks.h"

namespace pathkernels {

LeafKernel parse_leaf_kernel(c10::string_view name, at::ScalarType dtype, bool allow_gemm, const char* op,
                             const char* argument) {
  LeafKernel kernel;
  if (name == "simt") {
    kernel = LeafKernel::kSimt;
  } else if (name == "tf32x3") {
    kernel = LeafKernel::kTf32x3;
  } else if (name == "tf32") {
    kernel = LeafKernel::kTf32;
  } else if (name == "gemm" && allow_gemm) {
    kernel = LeafKernel::kGemm;
  } else {
    TORCH_CHECK_VALUE(false, op, ": expected ", argument, " in ('simt', 'tf32x3', 'tf32'",
                      allow_gemm ? ", 'gemm', or 'heads_' and a heads leaf variant)" : ")", ", got '",
                      std::string(name), "'");
  }
  TORCH_CHECK_TYPE(!(kernel == LeafKernel::kTf32x3 || kernel == LeafKernel::kTf32) || dtype == at::kFloat, op,
                   ": ", argument, "='", std::string(name), "' runs on TF32 tensor cores and takes torch.float32, got ",
                   dtype_name(dtype));
  return kernel;
}

PathChunk check_path_chunk(const at::Tensor& attn, const at::Tensor& attn_mean, const at::Tensor& root,
                           const at::Tensor& root_mean, const std::optional<at::Tensor>& w_v,
                           const std::optional<at::Tensor>& w_o, at::TensorList parents, at::TensorList heads,
                           int64_t leaf_block) {
  constexpr const char* op = "pathkernels.path_chunk_norms";
  TORCH_CHECK_VALUE(attn.dim() == 5, op, ": expected attn [B, L, H, n, n], got shape ", shape_string(attn.sizes()));
  const int64_t batch = attn.size(0), layers = attn.size(1), num_heads = attn.size(2), n = attn.size(3);
  TORCH_CHECK_VALUE(attn.size(4) == n, op, ": expected square attention [B, L, H, n, n], got ",
                    shape_string(attn.sizes()));
  TORCH_CHECK_TYPE(attn.scalar_type() == at::kFloat || attn.scalar_type() == at::kDouble, op,
                   ": expected attn to be float32 or float64, got ", dtype_name(attn.scalar_type()));
  TORCH_CHECK_VALUE(n >= 1 && layers >= 1 && num_heads >= 1, op,
                    ": expected attn [B, L, H, n, n] with L, H and n at least 1, got ", shape_string(attn.sizes()));
  const std::vector<int64_t> attn_mean_shape{batch, layers, num_heads, n};
  TORCH_CHECK_VALUE(attn_mean.sizes() == at::IntArrayRef(attn_mean_shape), op, ": expected attn_mean [B, L, H, n] = ",
                    shape_string(attn_mean_shape), ", got ", shape_string(attn_mean.sizes()));
  TORCH_CHECK_VALUE(root.dim() == 3 && root.size(0) == batch && root.size(1) == n, op,
                    ": expected root [B, n, m] with B = ", std::to_string(batch), " and n = ", std::to_string(n),
                    ", got ", shape_string(root.sizes()));
  const int64_t m = root.size(2);
  TORCH_CHECK_VALUE(m >= 1, op, ": expected root [B, n, m] with m >= 1, got ", shape_string(root.sizes()));
  const std::vector<int64_t> root_mean_shape{batch, m};
  TORCH_CHECK_VALUE(root_mean.sizes() == at::IntArrayRef(root_mean_shape), op, ": expected root_mean [B, m] = ",
                    shape_string(root_mean_shape), ", got ", shape_string(root_mean.sizes()));
  for (const at::Tensor* t : {&attn_mean, &root, &root_mean}) {
    TORCH_CHECK_TYPE(t->scalar_type() == attn.scalar_type(), op, ": expected every input in ",
                     dtype_name(attn.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    check_same_device(*t, attn, op, "every input", "attn");
  }
  TORCH_CHECK_VALUE(w_v.has_value() == w_o.has_value(), op, ": expected both w_v and w_o, or neither");
  if (w_v.has_value()) {
    const int64_t d_head = w_v->size(-1);
    const std::vector<int64_t> w_v_shape{layers, num_heads, m, d_head};
    const std::vector<int64_t> w_o_shape{layers, num_heads, d_head, m};
    TORCH_CHECK_VALUE(w_v->sizes() == at::IntArrayRef(w_v_shape), op, ": expected w_v [L, H, d, d_head] = ",
                      shape_string(w_v_shape), ", got ", shape_string(w_v->sizes()));
    TORCH_CHECK_VALUE(w_o->sizes() == at::IntArrayRef(w_o_shape), op, ": expected w_o [L, H, d_head, d] = ",
                      shape_string(w_o_shape), ", got ", shape_string(w_o->sizes()));
    TORCH_CHECK_TYPE(w_v->scalar_type() == attn.scalar_type() && w_o->scalar_type() == attn.scalar_type(), op,
                     ": expected w_v and w_o in ", dtype_name(attn.scalar_type()));
  } else {
    TORCH_CHECK_VALUE(m == n, op, ": without w_v and w_o the root must be [B, n, n], got ",
                      shape_string(root.sizes()));
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(parents.size()) == layers && static_cast<int64_t>(heads.size()) == layers,
                    op, ": expected ", std::to_string(layers), " levels of parents and heads, got ",
                    std::to_string(parents.size()), " and ", std::to_string(heads.size()));
  TORCH_CHECK_VALUE(leaf_block > 0, op, ": expected leaf_block > 0, got ", std::to_string(leaf_block));

  PathChunk chunk;
  int64_t previous = 1;
  for (int64_t l = 0; l < layers; ++l) {
    const std::string level = ": level " + std::to_string(l + 1);
    for (const at::Tensor* index : {&parents[l], &heads[l]}) {
      // A float or bool index would be truncated by the cast below into some other node.
      TORCH_CHECK_TYPE(at::isIntegralType(index->scalar_type(), /*includeBool=*/false), op, level,
                       ": expected parents and heads of an integer dtype (torch.long), got ",
                       dtype_name(index->scalar_type()));
    }
    at::Tensor parent = parents[l].to(at::kCPU, at::kLong).contiguous();
    at::Tensor head = heads[l].to(at::kCPU, at::kLong).contiguous();
    TORCH_CHECK_VALUE(parent.dim() == 1 && head.sizes() == parent.sizes(), op, level,
                      ": expected parents and heads of one shape [N], got ", shape_string(parent.sizes()), " and ",
                      shape_string(head.sizes()));
    if (parent.numel() > 0) {
      TORCH_CHECK_VALUE(parent.min().item<int64_t>() >= 0 && parent.max().item<int64_t>() < previous, op, level,
                        ": parent positions must lie in [0, ", std::to_string(previous), ")");
      TORCH_CHECK_VALUE(head.min().item<int64_t>() >= -1 && head.max().item<int64_t>() < num_heads, op, level,
                        ": heads must lie in [-1, ", std::to_string(num_heads), ")");
      TORCH_CHECK_VALUE(parent.numel() == 1 || (head.diff() >= 0).all().item<bool>(), op, level,
                        ": nodes must be sorted by head");
    }
    previous = parent.numel();
    chunk.parents.push_back(parent);
    chunk.heads.push_back(head);
  }
  return chunk;
}

FusedLeafOperands check_fused_leaf(const at::Tensor& attn, const at::Tensor& right, const at::Tensor& mean,
                                   const std::optional<at::Tensor>& scale, c10::string_view kernel) {
  constexpr const char* op = "pathkernels._fused_leaf_norms";
  TORCH_CHECK_VALUE(attn.dim() == 2 && attn.size(0) == attn.size(1), op, ": expected attn [n, n], got shape ",
                    shape_string(attn.sizes()));
  const int64_t n = attn.size(0);
  TORCH_CHECK_VALUE(n >= 1 && n <= fused_leaf::kMaxRows, op, ": expected 1 <= n <= ",
                    std::to_string(fused_leaf::kMaxRows), " rows, got n = ", std::to_string(n));
  TORCH_CHECK_VALUE(right.dim() == 3 && right.size(0) == n && right.size(2) >= 1, op,
                    ": expected right [n, c, m] with n = ", std::to_string(n), " and m >= 1, got shape ",
                    shape_string(right.sizes()));
  const std::vector<int64_t> mean_shape{right.size(1), right.size(2)};
  TORCH_CHECK_VALUE(mean.sizes() == at::IntArrayRef(mean_shape), op, ": expected mean [c, m] = ",
                    shape_string(mean_shape), ", got ", shape_string(mean.sizes()));
  TORCH_CHECK_TYPE(attn.scalar_type() == at::kFloat || attn.scalar_type() == at::kDouble, op,
                   ": expected attn to be float32 or float64, got ", dtype_name(attn.scalar_type()));
  for (const at::Tensor* t : {&right, &mean}) {
    TORCH_CHECK_TYPE(t->scalar_type() == attn.scalar_type(), op, ": expected right and mean in ",
                     dtype_name(attn.scalar_type()), ", got ", dtype_name(t->scalar_type()));
    check_same_device(*t, attn, op, "right and mean", "attn");
  }
  const LeafKernel leaf_kernel = parse_leaf_kernel(kernel, attn.scalar_type(), false, op, "kernel");
  const int64_t count = right.size(1);
  at::Tensor leaf_scale;
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->dim() == 1 && scale->size(0) == count, op, ": expected scale [c] = [",
                      std::to_string(count), "], got ", shape_string(scale->sizes()));
    TORCH_CHECK_TYPE(scale->scalar_type() == at::kDouble, op, ": expected scale in torch.float64, got ",
                     dtype_name(scale->scalar_type()));
    check_same_device(*scale, attn, op, "scale", "attn");
    leaf_scale = scale->contiguous();
    // A node's scale multiplies its norms: one that is not a positive finite number would give a
    // negative, infinite or NaN norm.
    TORCH_CHECK_VALUE(count == 0 || (leaf_scale.isfinite() & (leaf_scale > 0)).all().item<bool>(), op,
                      ": expected every scale to be a positive finite number");
  } else {
    leaf_scale = at::ones({count}, right.options().dtype(at::kDouble));
  }
  const int64_t m = right.size(2);
  // The kernels read element (i, k, j) of right at i·stride(0) + k·m + j: a stride of a dimension of
  // size 1 is never used (and may be anything, even for a contiguous tensor).
  const bool right_ok = (m <= 1 || right.stride(2) == 1) && (right.size(1) <= 1 || right.stride(1) == m);
  const bool mean_ok = mean.stride(1) == 1 || m <= 1;
  return {attn.contiguous(), right_ok ? right : right.contiguous(), mean_ok ? mean : mean.contiguous(), leaf_scale,
          leaf_kernel};
}

fused_leaf::Params fused_leaf_params(const FusedLeafOperands& ops, const at::Tensor& col_stats,
                                     const at::Tensor& row_stats) {
  TORCH_INTERNAL_ASSERT(ops.attn.is_contiguous() && (ops.right.size(2) <= 1 || ops.right.stride(2) == 1) &&
                        (ops.right.size(1) <= 1 || ops.right.stride(1) == ops.right.size(2)) &&
                        (ops.mean.size(1) <= 1 || ops.mean.stride(1) == 1) && ops.scale.is_contiguous() &&
                        ops.scale.scalar_type() == at::kDouble);
  fused_leaf::Params p;
  p.attn = ops.attn.const_data_ptr();
  p.n = ops.attn.size(0);
  p.right = ops.right.const_data_ptr();
  p.row_stride = ops.right.stride(0);
  p.leaf_stride = ops.right.size(2);
  p.count = ops.right.size(1);
  p.cols = ops.right.size(2);
  p.means = ops.mean.const_data_ptr();
  p.mean_stride = ops.mean.stride(0);
  p.scales = ops.scale.const_data_ptr<double>();
  p.col_stats = col_stats.mutable_data_ptr();
  p.row_stats = row_stats.mutable_data_ptr();
  p.tiles = fused_leaf::column_tiles(p.cols);
  return p;
}

std::tuple<at::Tensor, at::Tensor> fused_leaf_buffers(const FusedLeafOperands& ops) {
  const int64_t n = ops.attn.size(0), count = ops.right.size(1), m = ops.right.size(2);
  // The kernels accumulate in norm_acc_t<T> (fused_leaf.h's A), double for both float and double.
  static_assert(std::is_same_v<norm_acc_t<float>, double> && std::is_same_v<norm_acc_t<double>, double>);
  const auto options = ops.right.options().dtype(at::kDouble);
  return {at::empty({count, m, fused_leaf::kStats}, options),
          at::empty({count, fused_leaf::column_tiles(m), n, fused_leaf::kStats}, options)};
}

}  // namespace pathkernels
