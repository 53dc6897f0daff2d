// CPU fold of one chunk of per-leaf results into pk.path_statistics' accumulators: a
// few passes over the leaves in leaf order, one per group of accumulators, run as independent
// tasks on the CPU threads, where the torch code it replaces on CPU (PathStatistics._add_torch,
// kept for other devices and as this kernel's test oracle) takes ~40 passes of index_add_ and
// scatter_reduce_. Each accumulator sees the leaves in the same order (batch element, then leaf)
// as there, so the float64 sums agree bit for bit, whatever the number of threads. The log10 of the
// ratios comes from ATen's own (vectorised) log10 in one pass over the chunk, as in the torch fold,
// whose last bit libm's log10 could round apart.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/checks.h"

namespace pathkernels {
namespace {

constexpr int kMeasures = 3;    // ratio, residual, norm (statistics.py's _MEASURES)
constexpr int kHistograms = 2;  // ratio, residual (_HISTOGRAMS)

void check_accumulator(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  constexpr const char* op = "pathkernels._statistics_update";
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == shape, op,
                    ": expected ", name, " ", shape_string(shape), " contiguous ", dtype_name(dtype), " on the CPU, got ",
                    shape_string(t.sizes()), " ", dtype_name(t.scalar_type()), " on ", t.device().str());
}

// log10(v) to within 0.03 for normal v > 0 (-inf for 0), from the binary exponent and a chord of
// log2 over the mantissa, read from the bits: a bin guess for bin_of, at a fraction of
// std::log10's cost. Subnormal v get a guess further off, which bin_of's scans still correct.
inline double rough_log10(double v) {
  if (!(v > 0.0)) {
    return v == 0.0 ? -INFINITY : v;
  }
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const int64_t exponent = static_cast<int64_t>(bits >> 52) - 1023;  // v = f · 2^exponent, f in [1, 2)
  uint64_t fraction_bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
  double fraction;
  std::memcpy(&fraction, &fraction_bits, sizeof(fraction));
  constexpr double kLog10Of2 = 0.30102999566398120;
  return (static_cast<double>(exponent) + fraction - 1.0) * kLog10Of2;  // log2(f) ≈ f − 1, off by ≤ 0.09
}

// torch.bucketize(v, edges, right=True): the number of edges <= v (NaN: all of them, the last
// bin). The guess from (a rough) log10(v) is off by a bin or two at most, which the two scans fix;
// any ascending edges give the right bin, only more slowly if they are not log-spaced.
inline int64_t bin_of(double v, double log_v, const double* edge, int64_t num_edges, double log_first,
                      double per_decade) {
  if (std::isnan(v)) {
    return num_edges;
  }
  const double guess = std::floor((log_v - log_first) * per_decade) + 1.0;
  // NaN-safe: a guess that is not a number (edges the op refuses) starts the scan at 0, never casts.
  int64_t index = !(guess >= 0.0)                         ? 0
                  : guess > static_cast<double>(num_edges) ? num_edges
                                                           : static_cast<int64_t>(guess);
  while (index > 0 && edge[index - 1] > v) {
    --index;
  }
  while (index < num_edges && edge[index] <= v) {
    ++index;
  }
  return index;
}

// residual, norm [B, c] float64 (leaf order); lengths [c] int64 in [0, L]; edges [E] float64,
// ascending. Accumulators, updated in place: counts [B, L+1] int64, log10_ratio_sums [B, L+1],
// sums, sums_of_squares, minima, maxima [3, B, L+1] float64, histograms [2, B, L+1, E+1] int64;
// argmin, argmax [3, B, L+1] int64 are set to the chunk's first leaf reaching a new extreme (one
// strictly beyond the accumulator's before the chunk), and left as they are elsewhere.
void statistics_update(const at::Tensor& residual, const at::Tensor& norm, const at::Tensor& lengths,
                       const at::Tensor& edges, const at::Tensor& counts, const at::Tensor& log10_ratio_sums,
                       const at::Tensor& sums, const at::Tensor& sums_of_squares, const at::Tensor& minima,
                       const at::Tensor& maxima, const at::Tensor& argmin, const at::Tensor& argmax,
                       const at::Tensor& histograms) {
  constexpr const char* op = "pathkernels._statistics_update";
  TORCH_CHECK_VALUE(residual.dim() == 2, op, ": expected residual [B, c], got ", shape_string(residual.sizes()));
  const int64_t batch = residual.size(0), count = residual.size(1);
  TORCH_CHECK_VALUE(counts.dim() == 2 && counts.size(0) == batch, op, ": expected counts [B, L+1] with B = ",
                    std::to_string(batch), ", got ", shape_string(counts.sizes()));
  const int64_t levels = counts.size(1);
  const int64_t bins = edges.numel() + 1;
  check_accumulator(residual, at::kDouble, {batch, count}, "residual");
  check_accumulator(norm, at::kDouble, {batch, count}, "norm");
  check_accumulator(lengths, at::kLong, {count}, "lengths");
  check_accumulator(edges, at::kDouble, {bins - 1}, "edges");
  check_accumulator(counts, at::kLong, {batch, levels}, "counts");
  check_accumulator(log10_ratio_sums, at::kDouble, {batch, levels}, "log10_ratio_sums");
  for (const auto& [t, name] : {std::pair{&sums, "sums"}, {&sums_of_squares, "sums_of_squares"},
                                {&minima, "minima"}, {&maxima, "maxima"}}) {
    check_accumulator(*t, at::kDouble, {kMeasures, batch, levels}, name);
  }
  check_accumulator(argmin, at::kLong, {kMeasures, batch, levels}, "argmin");
  check_accumulator(argmax, at::kLong, {kMeasures, batch, levels}, "argmax");
  check_accumulator(histograms, at::kLong, {kHistograms, batch, levels, bins}, "histograms");
  // The bins are found from log10 of the edges, and by comparisons that assume them ordered.
  const double* e = edges.const_data_ptr<double>();
  for (int64_t i = 0; i < bins - 1; ++i) {
    TORCH_CHECK_VALUE(std::isfinite(e[i]) && e[i] > 0.0 && (i == 0 || e[i] > e[i - 1]), op,
                      ": expected edges to be positive, finite and strictly ascending; edge ", std::to_string(i),
                      " is ", number_string(e[i]), i > 0 ? " after " + number_string(e[i - 1]) : std::string());
  }
  const int64_t* length = lengths.const_data_ptr<int64_t>();
  for (int64_t k = 0; k < count; ++k) {
    TORCH_CHECK_INDEX(length[k] >= 0 && length[k] < levels, op, ": lengths must lie in [0, ",
                      std::to_string(levels), "), got ", std::to_string(length[k]), " at leaf ", std::to_string(k));
  }

  const double* edge = edges.const_data_ptr<double>();
  // The edges are log-spaced (statistics.histogram_edges): a value's bin is guessed from its log.
  const int64_t num_edges = bins - 1;
  const double log_first = num_edges > 0 ? std::log10(edge[0]) : 0.0;
  const double per_decade =
      num_edges > 1 ? static_cast<double>(num_edges - 1) / (std::log10(edge[num_edges - 1]) - log_first) : 0.0;
  const int64_t plane = batch * levels;  // one measure's [B, L+1]
  int64_t* count_of = counts.mutable_data_ptr<int64_t>();
  double* log_sum = log10_ratio_sums.mutable_data_ptr<double>();
  double* sum = sums.mutable_data_ptr<double>();
  double* square = sums_of_squares.mutable_data_ptr<double>();
  double* low = minima.mutable_data_ptr<double>();
  double* high = maxima.mutable_data_ptr<double>();
  int64_t* low_leaf = argmin.mutable_data_ptr<int64_t>();
  int64_t* high_leaf = argmax.mutable_data_ptr<int64_t>();
  int64_t* histogram = histograms.mutable_data_ptr<int64_t>();
  const double* all_residuals = residual.const_data_ptr<double>();
  const double* all_norms = norm.const_data_ptr<double>();

  // [B, c] ratios, divided once (ATen, vectorised) for every task: the torch fold's residual / norm.
  const at::Tensor ratios = residual / norm;
  const double* all_ratios = ratios.const_data_ptr<double>();
  const double* measures[kMeasures] = {all_ratios, all_residuals, all_norms};
  // Calls fn(k, slot, v) for every leaf in order (batch element, then leaf), v its value of `measure`.
  const auto for_each_leaf = [&](int measure, auto&& fn) {
    for (int64_t b = 0; b < batch; ++b) {
      const double* values = measures[measure] + b * count;
      for (int64_t k = 0; k < count; ++k) {
        fn(k, b * levels + length[k], values[k]);
      }
    }
  };
  // Independent tasks, each owning its accumulators and visiting the leaves in order, so that
  // threads change no bit: the counts and log sums, each measure's moments and extremes, each
  // histogram.
  constexpr int64_t kTasks = 1 + kMeasures + kHistograms;
  at::parallel_for(0, kTasks, 1, [&](int64_t first_task, int64_t last_task) {
    for (int64_t task = first_task; task < last_task; ++task) {
      if (task == 0) {
        // [B, c]: the torch fold's positive_log10(ratio), log10 where the ratio is not 0 and 0 where it
        // is (exact zeros are counted apart, in histogram bin 0; NaN stays NaN), with the same ATen
        // kernels, run here (serially: inside a parallel region) beside the other tasks.
        const at::Tensor log_ratios = at::where(ratios == 0, at::zeros({}, ratios.options()), at::log10(ratios));
        const double* log_ratio = log_ratios.const_data_ptr<double>();
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t k = 0; k < count; ++k) {
            const int64_t slot = b * levels + length[k];
            count_of[slot] += 1;
            log_sum[slot] += log_ratio[b * count + k];
          }
        }
      } else if (task <= kMeasures) {
        const int m = static_cast<int>(task - 1);
        for_each_leaf(m, [&](int64_t k, int64_t slot, double v) {
          const int64_t at = m * plane + slot;
          sum[at] += v;
          square[at] += v * v;
          if (v < low[at]) {  // strict: the first leaf reaching an extreme keeps it; NaN never does
            low[at] = v;
            low_leaf[at] = k;
          }
          if (v > high[at]) {
            high[at] = v;
            high_leaf[at] = k;
          }
        });
      } else {
        const int h = static_cast<int>(task - 1 - kMeasures);
        for_each_leaf(h, [&](int64_t, int64_t slot, double v) {
          histogram[(h * plane + slot) * bins + bin_of(v, rough_log10(v), edge, bins - 1, log_first, per_decade)] +=
              1;
        });
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(pathkernels, CPU, m) {
  m.impl("_statistics_update", &statistics_update);
}

}  // namespace pathkernels
