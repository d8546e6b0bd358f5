// Paged attention for decode rows on the CPU: one query token per sequence, its context
// read in place from the paged KV cache (no dense copy), softmax in float32.
//
//   q            [B, Hq, D]                  float32, contiguous
//   k/v_cache    [num_blocks, bs, Hkv, D]    float32, contiguous
//   block_tables [B, max_blocks]             int32: block ids of each sequence
//   seq_lens     [B]                         int32: context length, this token included
//   returns      [B, Hq, D]
//
// Each key and value row is read once, for all the query heads (GQA: query head h reads KV
// head h / G); sequences are the work items of `at::parallel_for`.
// Reading the context is the cost (memory bound). Built with -ffast-math so that the exp
// loop vectorises (glibc's libmvec); results match the torch reference
// (torch_backend.decode_attention) to float32 rounding.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr float kMinExponent = -30.f;

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode_attention: float32 q and caches only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_attention: int32 block_tables and seq_lens");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: contiguous tensors only");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim,
              "paged_decode_attention: q and cache shapes disagree");
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;

  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);

  // One work item per sequence: its blocks are read front to back, each token's K (or V)
  // row [Hkv, D] whole, so the memory is streamed as torch's block copy would stream it.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(num_heads * head_dim);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const float* query = q_ptr + seq * num_heads * head_dim;  // [Hq, D]
      float* dst = out_ptr + seq * num_heads * head_dim;
      if (len <= 0) {  // nothing to attend to (never planned, but no garbage either)
        std::fill(dst, dst + num_heads * head_dim, 0.f);
        continue;
      }
      const int32_t* table = tables + seq * max_blocks;
      auto row = [&](const float* cache, int64_t t) {  // token t's [Hkv, D]
        return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride;
      };
      scores.resize(num_heads * len);  // [Hq, len]
      for (int64_t t = 0; t < len; ++t) {
        const float* key = row(k_ptr, t);
        for (int64_t head = 0; head < num_heads; ++head)
          scores[head * len + t] =
              softmax_scale * dot(query + head * head_dim, key + (head / group) * head_dim, head_dim);
      }
      for (int64_t head = 0; head < num_heads; ++head) {
        float* s = scores.data() + head * len;
        float max_score = s[0];  // no infinities: the kernel is built with -ffast-math
        for (int64_t t = 1; t < len; ++t) max_score = std::max(max_score, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          // exp(x) < 1e-13 is below float32 rounding beside the max term (1): make it 0,
          // and keep exp's argument where the vector exp has no slow path
          const float x = s[t] - max_score;
          s[t] = x < kMinExponent ? 0.f : std::exp(std::max(x, kMinExponent));
          sum += s[t];
        }
        const float inv_sum = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv_sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* value = row(v_ptr, t);
        for (int64_t head = 0; head < num_heads; ++head)
          axpy(scores[head * len + t], value + (head / group) * head_dim,
               acc.data() + head * head_dim, head_dim);
      }
      std::copy(acc.begin(), acc.end(), dst);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a float32 KV cache (CPU)");
}
