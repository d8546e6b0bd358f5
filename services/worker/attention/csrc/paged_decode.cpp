// Paged attention on the CPU, the context read in place from the paged KV cache (no dense
// copy), softmax in float32:
//   paged_decode_attention: decode rows, one query token per sequence;
//   paged_chunk_attention:  chunks of several rows (speculative steps, prefill), below.
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// Chunks (a speculative step's k + 1 rows, prompts and prefill chunks): every query row of a
// sequence's chunk against the sequence's context, causal within the chunk (row r of a
// chunk of n rows at the end of a context of len tokens sees keys 0 .. len - n + r).
//
//   q               [T, Hq, D]   float32 or bfloat16, contiguous: the chunks' rows, in order
//   k/v_cache       [num_blocks, bs, Hkv, D]  float32 or bfloat16, both alike
//   query_start_loc [B + 1]      int32: rows of sequence b are [qsl[b], qsl[b + 1])
//   seq_lens        [B]          int32: context length, the chunk included
//   returns         [T, Hq, D]   q's dtype (float32 sums, rounded once at the end)
//
// A work item is (sequence, up to kRowsPerItem of its chunk's rows, KV head): the K and V
// rows those rows see are read once, for all of them and the G query heads that share the
// KV head (n * G query vectors), where the decode kernel would read them once per row.
// Scores are computed a tile of kTile keys at a time against a transposed copy of the tile,
// so the inner loop is a vector FMA over the tile's keys (a small GEMM: the torch path
// instead copied every context into a padded dense tensor and ran SDPA with a dense mask,
// ~3x the time at 16 x 5 rows). Causal: a block of query vectors skips the key tiles none
// of its rows sees, in the scores and in the sums (half the work of a whole prompt).
// Caches of float32 or bfloat16 (widened as the tiles are copied), q and results of float32
// or bfloat16: the arithmetic is float32 throughout.
constexpr int64_t kTile = 16;     // keys per score tile; head_dim is a multiple of it
constexpr int64_t kRowsPerItem = 32;  // a work item's rows of a chunk: a long prompt's
                                      // rows spread over the threads, not only its KV heads
#ifdef __AVX512F__
constexpr int64_t kQueries = 8;   // query vectors per register block: a zmm accumulator each
#else
constexpr int64_t kQueries = 4;   // query vectors per register block: two ymm accumulators each
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 bits -> float32: the high half of a float
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

template <typename Q, typename T>  // q and results float or at::BFloat16; caches float or bf16 bits
void chunk_attention(const Q* q_ptr, const T* k_ptr, const T* v_ptr, const int32_t* tables,
                     const int32_t* lens, const int32_t* starts, Q* out_ptr,
                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                     int64_t block_size, int64_t max_blocks, float softmax_scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t row_stride = num_heads * head_dim;
  struct Part {
    int64_t seq, first_row;  // of q
  };
  std::vector<Part> parts;  // each sequence's rows kRowsPerItem at a time
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = lens[seq], num_rows = starts[seq + 1] - starts[seq];
    if (num_rows <= 0 || len < num_rows) continue;  // nothing to attend (rows stay 0)
    for (int64_t r = 0; r < num_rows; r += kRowsPerItem) parts.push_back({seq, starts[seq] + r});
  }
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  at::parallel_for(0, num_parts * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, key_tile(head_dim * kTile), scores, value_slices, acc;
    for (int64_t item = begin; item < end; ++item) {
      const Part part = parts[item / num_kv_heads];
      const int64_t seq = part.seq, kv_head = item % num_kv_heads, first_row = part.first_row;
      const int64_t num_rows = std::min(kRowsPerItem, starts[seq + 1] - first_row);
      // the part's first row sees keys 0 .. first_pos; its last row, all `len` it needs
      const int64_t first_pos = lens[seq] - (starts[seq + 1] - first_row);
      const int64_t len = first_pos + num_rows;
      const int32_t* table = tables + seq * max_blocks;
      auto row = [&](const T* cache, int64_t t) {  // token t's [D] of this KV head
        return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
               kv_head * head_dim;
      };
      // query vector i = r * G + g (row r, query head kv_head * G + g), pre-scaled; padded
      // with zero vectors to a multiple of kQueries. Vector i sees keys 0 .. first_pos + r.
      const int64_t num_queries = num_rows * group;
      const int64_t padded = (num_queries + kQueries - 1) / kQueries * kQueries;
      auto keys_seen = [&](int64_t i0) {  // keys the query block at i0 sees, at most
        const int64_t last = std::min(i0 + kQueries, num_queries) - 1;
        return last < i0 ? int64_t{0} : first_pos + last / group + 1;
      };
      query.assign(padded * head_dim, 0.f);
      for (int64_t r = 0; r < num_rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const Q* src = q_ptr + (first_row + r) * row_stride + (kv_head * group + g) * head_dim;
          float* dst = query.data() + (r * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = softmax_scale * widen(src[d]);
        }
      const int64_t stride = (len + kTile - 1) / kTile * kTile;  // scores [padded, stride]
      scores.resize(padded * stride);
      for (int64_t t0 = 0; t0 < len; t0 += kTile) {
        const int64_t num_keys = std::min(kTile, len - t0);
        std::fill(key_tile.begin(), key_tile.end(), 0.f);  // [D, kTile], zero past the end
        for (int64_t j = 0; j < num_keys; ++j) {
          const T* key = row(k_ptr, t0 + j);
          for (int64_t d = 0; d < head_dim; ++d) key_tile[d * kTile + j] = widen(key[d]);
        }
        // causal: vectors before G * (t0 - first_pos) see none of this tile's keys
        const int64_t first_seeing = std::max<int64_t>(0, (t0 - first_pos) * group);
        for (int64_t i0 = first_seeing / kQueries * kQueries; i0 < padded; i0 += kQueries) {
          float dots[kQueries][kTile] = {};  // kQueries x kTile in registers
          const float* qv = query.data() + i0 * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) {
            const float* keys = key_tile.data() + d * kTile;
            for (int64_t b = 0; b < kQueries; ++b) {
              const float x = qv[b * head_dim + d];
#pragma omp simd
              for (int64_t j = 0; j < kTile; ++j) dots[b][j] += x * keys[j];
            }
          }
          for (int64_t b = 0; b < kQueries; ++b)
            std::copy(dots[b], dots[b] + kTile, scores.data() + (i0 + b) * stride + t0);
        }
      }
      for (int64_t i = 0; i < padded; ++i) {  // softmax over the keys query i sees; 0 after
        float* s = scores.data() + i * stride;
        const int64_t visible = i < num_queries ? first_pos + i / group + 1 : 0;
        if (visible > 0) {
          float max_score = s[0];
          for (int64_t t = 1; t < visible; ++t) max_score = std::max(max_score, s[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < visible; ++t) {
            const float x = s[t] - max_score;  // as in the decode kernel
            s[t] = x < kMinExponent ? 0.f : std::exp(std::max(x, kMinExponent));
            sum += s[t];
          }
          const float inv_sum = 1.f / sum;
          for (int64_t t = 0; t < visible; ++t) s[t] *= inv_sum;
        }
        std::fill(s + visible, s + keys_seen(i / kQueries * kQueries), 0.f);
      }
      // out = p @ V. V is copied once (widened) into slices of kTile columns,
      // [D / kTile, len, kTile], so that each pass below streams one slice (len * 64 bytes,
      // in L1) rather than gathering the paged rows again
      value_slices.resize(head_dim * len);
      for (int64_t t = 0; t < len; ++t) {
        const T* value = row(v_ptr, t);
        for (int64_t c = 0; c < head_dim; c += kTile)
          for (int64_t j = 0; j < kTile; ++j)
            value_slices[c * len + t * kTile + j] = widen(value[c + j]);
      }
      acc.resize(padded * head_dim);
      for (int64_t c = 0; c < head_dim; c += kTile) {
        const float* slice = value_slices.data() + c * len;
        for (int64_t i0 = 0; i0 < padded; i0 += kQueries) {  // kQueries x kTile in registers
          float sums[kQueries][kTile] = {};
          const int64_t seen = keys_seen(i0);  // later keys have probability 0 in the block
          for (int64_t t = 0; t < seen; ++t) {
            const float* value = slice + t * kTile;
            for (int64_t b = 0; b < kQueries; ++b) {
              const float p = scores[(i0 + b) * stride + t];
#pragma omp simd
              for (int64_t j = 0; j < kTile; ++j) sums[b][j] += p * value[j];
            }
          }
          for (int64_t b = 0; b < kQueries; ++b)
            std::copy(sums[b], sums[b] + kTile, acc.data() + (i0 + b) * head_dim + c);
        }
      }
      for (int64_t r = 0; r < num_rows; ++r)
        for (int64_t g = 0; g < group; ++g)
          std::copy_n(acc.data() + (r * group + g) * head_dim, head_dim,  // rounded to Q as torch
                      out_ptr + (first_row + r) * row_stride + (kv_head * group + g) * head_dim);
    }
  });
}

}  // namespace

torch::Tensor paged_chunk_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                    const torch::Tensor& v_cache,
                                    const torch::Tensor& block_tables,
                                    const torch::Tensor& seq_lens,
                                    const torch::Tensor& query_start_loc, double scale) {
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  v_cache.scalar_type() == cache_type &&
                  (cache_type == at::kFloat || cache_type == at::kBFloat16),
              "paged_chunk_attention: float32 or bfloat16 q, and float32 or bfloat16 caches "
              "(both alike)");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_chunk_attention: int32 block_tables, seq_lens and query_start_loc");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "paged_chunk_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  block_tables.dim() == 2 && seq_lens.dim() == 1 && query_start_loc.dim() == 1,
              "paged_chunk_attention: shapes disagree");
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0,  // divisors below
              "paged_chunk_attention: an empty cache block or no KV head");
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim &&
                  query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "paged_chunk_attention: shapes disagree");
  TORCH_CHECK(head_dim % kTile == 0, "paged_chunk_attention: head_dim must be a multiple of 16");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0),
              "paged_chunk_attention: query_start_loc does not cover q's rows");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t seq = 0; seq < num_seqs; ++seq) {  // every block read is in the cache
    TORCH_CHECK(starts[seq + 1] >= starts[seq], "paged_chunk_attention: query_start_loc decreases");
    const int64_t len = lens[seq];
    if (len <= 0 || starts[seq + 1] == starts[seq]) continue;
    TORCH_CHECK((len + block_size - 1) / block_size <= max_blocks,
                "paged_chunk_attention: a context beyond the block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      const int32_t id = tables[seq * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_chunk_attention: bad block id ", id);
    }
  }

  auto out = torch::zeros_like(q);
  const float softmax_scale = static_cast<float>(scale);
  const auto run = [&](const auto* k, const auto* v) {
    const auto attend = [&](const auto* q_ptr, auto* out_ptr) {
      chunk_attention(q_ptr, k, v, tables, lens, starts, out_ptr, num_seqs, num_heads,
                      num_kv_heads, head_dim, block_size, max_blocks, softmax_scale);
    };
    if (q.scalar_type() == at::kFloat) {
      attend(q.data_ptr<float>(), out.data_ptr<float>());
    } else {
      attend(q.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
    }
  };
  if (cache_type == at::kFloat) {
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  }
  return out;
}

// Without the GIL, as torch's own ops run (model/csrc/cpu_ops.cpp says why).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a float32 KV cache (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_chunk_attention", &paged_chunk_attention,
        "Paged attention of chunks (causal) over a float32 or bfloat16 KV cache (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
