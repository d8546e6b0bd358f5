// Small-batch matmuls for the CPU decode step: y = (x @ W.T) * scale + bias for a few rows.
//
//   x      [M, K]  float32, contiguous, M <= kMaxRows (the rows that decode this step)
//   W      [N, K]  float32, bfloat16 or int8, contiguous (the plain, unpacked weight)
//   scale  [N]     float32 or undefined: per-output-channel scale of int8 weights
//   bias   [N]     float32 or undefined
//   returns [M, N] float32
//
// Why: with one or two rows a decode step is a stream of weight bytes (every weight read
// once, 2 flops each), so what counts is how fast W comes in from memory. oneDNN's packed
// GEMM and torch's int8 kernel tile for many rows; here each thread reads its own block of
// whole weight rows front to back, widens them to float32 in registers, and dots them with
// every row of x while they sit in L1 (docs/performance.md has the measurements).
// Accumulation is in float32, in vector lanes: results match the reference matmul to
// float32 rounding, not bit for bit.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kRowsPerTask = 16;  // output channels per parallel work item (grain)

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t v) {  // bfloat16 bits -> float32: the high half of a float
  return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
}

template <typename W, int64_t R>
void dot_rows(const float* x, const W* weight, const float* scale, const float* bias, float* out,
              int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* w = weight + n * K;
    float acc[R];
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += xr[k] * widen(w[k]);
      acc[r] = sum;
    }
    const float s = scale ? scale[n] : 1.f, b = bias ? bias[n] : 0.f;
    for (int64_t r = 0; r < R; ++r) out[r * N + n] = acc[r] * s + b;
  }
}

template <typename W>
void run(int64_t M, const float* x, const W* w, const float* scale, const float* bias, float* out,
         int64_t K, int64_t N) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: return dot_rows<W, 1>(x, w, scale, bias, out, K, N, begin, end);
      case 2: return dot_rows<W, 2>(x, w, scale, bias, out, K, N, begin, end);
      case 3: return dot_rows<W, 3>(x, w, scale, bias, out, K, N, begin, end);
      default: return dot_rows<W, 4>(x, w, scale, bias, out, K, N, begin, end);
    }
  });
}

}  // namespace

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& scale,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_linear: 1 to ", kMaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && weight.is_contiguous(),
              "small_linear: contiguous float32 x and a contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* scale_ptr = nullptr;
  const float* bias_ptr = nullptr;
  if (scale.has_value() && scale->defined()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == N && scale->is_contiguous(),
                "small_linear: scale must be [N] contiguous float32");
    scale_ptr = scale->data_ptr<float>();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(),
                "small_linear: bias must be [N] contiguous float32");
    bias_ptr = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat:
      run(M, xp, weight.data_ptr<float>(), scale_ptr, bias_ptr, op, K, N);
      break;
    case at::kBFloat16:
      run(M, xp, reinterpret_cast<const uint16_t*>(weight.data_ptr()), scale_ptr, bias_ptr, op, K, N);
      break;
    case at::kChar:
      run(M, xp, weight.data_ptr<int8_t>(), scale_ptr, bias_ptr, op, K, N);
      break;
    default:
      TORCH_CHECK(false, "small_linear: float32, bfloat16 or int8 weights, got ",
                  weight.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x @ W.T * scale + bias for 1-4 rows (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("scale") = py::none(),
        py::arg("bias") = py::none());
  m.attr("max_rows") = kMaxRows;
}
