// CPU kernels for the decode step (model/cpu_ops.py): a small-batch matmul, and the
// elementwise work of a decoder layer fused into one pass each (RMSNorm, residual add +
// RMSNorm, SiLU * up, RoPE of q and k + the KV cache write), which in eager PyTorch costs
// 4-20 dispatched ops apiece: at one request per step that dispatch, not arithmetic, is
// the time.
//
// small_linear: y = (x @ W.T) * scale + bias for a few rows.
//
//   x      [M, K]  float32 or bfloat16, M <= kMaxRows (the rows that decode this step),
//                  any M for int8 weights (their exact integer path, below)
//   W      [N, K]  float32, bfloat16 or int8, contiguous (the plain, unpacked weight)
//   scale  [N]     or undefined: per-output-channel scale of int8 weights
//   bias   [N]     or undefined
//   packed         or undefined: int8_pack_amx(W), the AMX copy of int8 weights (batches of
//                  kAmxMinRows rows on, where the CPU has AMX-INT8)
//   returns [M, N] in x's dtype (computed in float32)
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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <immintrin.h>
#if defined(__AVX2__)
#include <sleef.h>  // torch's own vector math (libtorch_cpu exports it)
#endif
#include <cstring>
#include <limits>
#include <cmath>
#include <tuple>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#endif

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int64_t kRowsPerTask = 16;  // output channels per parallel work item (grain)

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 bits -> float32: the high half of a float
  return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16);
}

// 8 weights widened to float32 lanes (AVX2 builds).
#if defined(__AVX2__) && !defined(__AVX512F__)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {  // bfloat16: the high half of each float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

// 16 weights widened to float32 lanes (AVX-512 builds only).
#ifdef __AVX512F__
inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load16(const uint16_t* w) {  // bfloat16: the high half of each float
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

// Bytes ahead of a streaming loop that it asks the cache for, once per cache line: the
// hardware prefetchers do not run far enough ahead of a busy loop, so the memory wait and
// the arithmetic add up instead of overlapping (an AVX2 AMD EPYC: docs/performance.md, "On
// CPUs without AVX-512"; a Xeon with AVX-512 and AMX: a decode step's 1-row matmuls
// 0.7-0.8x the time with it, "Software prefetch in the decode matmuls" there). 1, 2 and 4
// KiB measured alike.
constexpr int64_t kStreamAhead = 2048;

// x . w over K: four accumulators (AVX-512 or AVX2), since one chain of dependent FMAs
// waits on the FMA latency, which for bfloat16 weights (a widening per vector) is slower
// than memory; the compiler does not split a reduction by itself (on an AVX2 Zen 2 core,
// its one-accumulator loop read bfloat16 weights at ~8 GB/s, about the FMA latency).
template <typename W>
inline float dot(const float* x, const W* w, int64_t K) {
  int64_t k = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 64 <= K; k += 64) {
    for (int64_t line = 0; line < 64 * int64_t(sizeof(W)); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + kStreamAhead + line, _MM_HINT_T0);
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(w + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), load16(w + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), load16(w + k + 48), a3);
  }
  for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), a0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load8(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load8(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load8(w + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load8(w + k), a0);
  const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
  for (; k < K; ++k) sum += x[k] * widen(w[k]);
  return sum;
}

// bfloat16 weights and activations on CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids
// on; Zen 4): `vdpbf16ps` multiplies 32 bfloat16 pairs and adds them into 16 float32 lanes,
// one instruction where widening the weights takes six per 32 (two loads, two widenings,
// two FMAs). The product of two bfloat16 values is exact in float32, so each step rounds
// once, as an FMA does; only the order of the sums differs from the widening path's. It
// also asks for the weights farther ahead and into L2 (into L1, the line fill buffers
// bound a core's reads): 1-4 rows of SmolLM2's decode matmuls in 0.68-0.81x the time of the
// widening path (docs/performance.md, "bfloat16 on AVX512-BF16 and AMX tiles"). Like every
// AVX512-BF16 and AMX-BF16 instruction it treats subnormal values (below ~1.2e-38) as zero.
// The activations must be bfloat16
// already (a bf16 model's are): rounding float32 ones would lose their precision.
#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 11)
#define CONVEYOR_BF16_DOT 1
constexpr int64_t kBf16Ahead = 4096;  // bytes; 2 KiB into L1: 1.1x the time, 8 KiB alike

bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512bf16") &&
                                __builtin_cpu_supports("avx512bw");
  return supported;
}

bool& bf16_dot_enabled() {  // `use_bf16_dot`: the tests compare the two paths
  static bool enabled = has_bf16_dot();
  return enabled;
}

#define BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
BF16_TARGET inline __m512bh load_bf16(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

BF16_TARGET inline void prefetch_weights(const uint16_t* w, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w) + kBf16Ahead + line, _MM_HINT_T1);
}

// out[r * N + n] = (x_r . w_n) * scale[n] + bias[n] for n in [begin, end), r < R: each
// weight vector loaded once for all R rows; one row takes four accumulators (a chain of
// dependent dot instructions waits on their latency), more rows two each.
template <int64_t R>
BF16_TARGET void dot_rows_bf16(const uint16_t* x, const uint16_t* weight, const float* scale,
                               const float* bias, float* out, int64_t K, int64_t N,
                               int64_t begin, int64_t end) {
  constexpr int64_t kAcc = R == 1 ? 4 : 2, kStep = 32 * kAcc;
  for (int64_t n = begin; n < end; ++n) {
    const uint16_t* w = weight + n * K;
    __m512 acc[R][kAcc];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t a = 0; a < kAcc; ++a) acc[r][a] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + kStep <= K; k += kStep) {
      prefetch_weights(w + k, 2 * kStep);
      for (int64_t a = 0; a < kAcc; ++a) {
        const __m512bh wv = load_bf16(w + k + 32 * a);
        for (int64_t r = 0; r < R; ++r)
          acc[r][a] = _mm512_dpbf16_ps(acc[r][a], load_bf16(x + r * K + k + 32 * a), wv);
      }
    }
    for (; k + 32 <= K; k += 32) {
      const __m512bh wv = load_bf16(w + k);
      for (int64_t r = 0; r < R; ++r)
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], load_bf16(x + r * K + k), wv);
    }
    const float s = scale ? scale[n] : 1.f, b = bias ? bias[n] : 0.f;
    for (int64_t r = 0; r < R; ++r) {
      __m512 total = acc[r][0];
      for (int64_t a = 1; a < kAcc; ++a) total = _mm512_add_ps(total, acc[r][a]);
      float sum = _mm512_reduce_add_ps(total);
      for (int64_t t = k; t < K; ++t) sum += widen(x[r * K + t]) * widen(w[t]);
      out[r * N + n] = sum * s + b;
    }
  }
}
#undef BF16_TARGET

void run_bf16(int64_t M, const uint16_t* x, const uint16_t* w, const float* scale,
              const float* bias, float* out, int64_t K, int64_t N) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: return dot_rows_bf16<1>(x, w, scale, bias, out, K, N, begin, end);
      case 2: return dot_rows_bf16<2>(x, w, scale, bias, out, K, N, begin, end);
      case 3: return dot_rows_bf16<3>(x, w, scale, bias, out, K, N, begin, end);
      default: return dot_rows_bf16<4>(x, w, scale, bias, out, K, N, begin, end);
    }
  });
}
#else
bool has_bf16_dot() { return false; }
bool& bf16_dot_enabled() {
  static bool enabled = false;
  return enabled;
}
#endif

template <typename W, int64_t R>
void dot_rows(const float* x, const W* weight, const float* scale, const float* bias, float* out,
              int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* w = weight + n * K;
    float acc[R];
    for (int64_t r = 0; r < R; ++r) acc[r] = dot(x + r * K, w, K);
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

// int8 weights, any number of rows: the activations rounded to int16 per row (x ~= xq * amax
// / 32767, error <= amax / 65534 per element, finer than the bfloat16 activations torch's
// int8 kernel takes) and dotted with the weights widened to int16, in exact integer sums.
// Exact sums make a row's result independent of everything else: of the batch around it
// (sync and async scheduling batch requests differently and must give the same tokens), of
// the tiling below, and of the instruction set, so AVX512-VNNI (`vpdpwssd`, 32 weights per
// 2 vector ops where the float path needs 6 per 32: bound by memory, not by widening), AVX2
// (`vpmaddwd`) and plain C++ all give the same bits. Bounds: |q| <= 127, |xq| <= 32767; a
// vector lane takes at most kChunk / 8 products (< 2^31) before it is added into int64.
constexpr int64_t kChunk = 2048;  // k per int32 accumulation; a multiple of 32
constexpr int64_t kTileX = 4;     // rows of x per tile (register blocking)
constexpr int64_t kTileW = 4;     // weight rows per tile
constexpr int64_t kTileWAvx2 = 2; // on AVX2: 4 x 2 accumulators and 2 weight vectors fit its 16
                                  // registers, 4 x 4 spilled (64 rows: 1.2-1.3x faster)

bool has_vnni() {
  static const bool supported = __builtin_cpu_supports("avx512vnni") &&
                                __builtin_cpu_supports("avx512bw");
  return supported;
}

bool has_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
}

// AMX-INT8 (Sapphire Rapids on): the CPU says so in CPUID (leaf 7: EDX bit 24 AMX-TILE,
// bit 25 AMX-INT8) and Linux lends the tile registers' state to a process that asks for it
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per process: without that the
// first tile instruction faults.
#if defined(__linux__) && defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define CONVEYOR_AMX 1
#endif

#ifdef CONVEYOR_AMX
// Whether CPUID leaf 7 sets all of EDX's `bits` and Linux lends this process the tiles.
bool amx_with(unsigned bits) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (edx & bits) != bits) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm,
                                        kXfeatureXtiledata) == 0;
  return permitted;
}
#endif

bool has_amx() {
#ifdef CONVEYOR_AMX
  static const bool supported = has_vnni() && amx_with((1u << 24) | (1u << 25));
  return supported;
#else
  return false;
#endif
}

// AMX-BF16 (EDX bit 22) beside AMX-TILE, and AVX512-BF16 (the outputs' rounding).
bool has_amx_bf16() {
#if defined(CONVEYOR_AMX) && defined(CONVEYOR_BF16_DOT)
  static const bool supported = has_bf16_dot() && amx_with((1u << 22) | (1u << 24));
  return supported;
#else
  return false;
#endif
}

// The instruction sets this CPU runs the int8 dot with, best first; `int8_isa` is the one
// used (the best, unless `use_int8_isa` picked another: the tests compare them). "amx" is
// AVX512-VNNI for batches under kAmxMinRows rows and for weights without an AMX copy.
enum class Isa { kAmx, kVnni, kAvx2, kScalar };
constexpr const char* kIsaNames[] = {"amx", "avx512_vnni", "avx2", "scalar"};

std::vector<Isa> int8_isas() {
  std::vector<Isa> isas;
  if (has_amx()) isas.push_back(Isa::kAmx);
  if (has_vnni()) isas.push_back(Isa::kVnni);
  if (has_avx2()) isas.push_back(Isa::kAvx2);
  isas.push_back(Isa::kScalar);
  return isas;
}

Isa& int8_isa() {
  static Isa isa = int8_isas().front();
  return isa;
}

std::vector<std::string> int8_isa_names() {
  std::vector<std::string> names;
  for (Isa isa : int8_isas()) names.emplace_back(kIsaNames[static_cast<int>(isa)]);
  return names;
}

// Whether bfloat16 weights and activations take the AVX512-BF16 dot (`dot_rows_bf16`): set
// to `enabled` where this CPU has it (the tests and the benchmark compare the two paths);
// returns whether it is on.
bool use_bf16_dot(bool enabled) {
  bf16_dot_enabled() = enabled && has_bf16_dot();
  return bf16_dot_enabled();
}

void use_int8_isa(const std::string& name) {
  for (Isa isa : int8_isas())
    if (name == kIsaNames[static_cast<int>(isa)]) {
      int8_isa() = isa;
      return;
    }
  TORCH_CHECK(false, "use_int8_isa: ", name, " does not run on this CPU");
}

// A tile: sums[i * RW + j] = xq[i] . w[j] over K, for RX rows of x (stride K) and RW weight
// rows (stride K, int8 or int16). Each vector of w and of x is loaded once per tile.
template <typename W, int RX, int RW>
void tile_scalar(const int16_t* xq, const W* w, int64_t K, int64_t* sums) {
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j) {
      int64_t sum = 0;
      for (int64_t k = 0; k < K; ++k)
        sum += static_cast<int32_t>(xq[i * K + k]) * static_cast<int32_t>(w[j * K + k]);
      sums[i * RW + j] = sum;
    }
}

template <typename W, int RX, int RW>
void tail_sums(const int16_t* xq, const W* w, int64_t K, int64_t k, int64_t* sums) {
  for (int i = 0; i < RX; ++i)
    for (int j = 0; j < RW; ++j)
      for (int64_t t = k; t < K; ++t)
        sums[i * RW + j] += static_cast<int32_t>(xq[i * K + t]) * static_cast<int32_t>(w[j * K + t]);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i load32(const int8_t* w) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i load32(const int16_t* w) {
  return _mm512_loadu_si512(w);
}
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline int64_t lanes_sum(__m512i v) {
  const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v));
  const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

// 32 k per step, 2 products per lane per step: kChunk / 16 products per lane.
template <typename W, int RX, int RW>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const int16_t* xq,
                                                                        const W* w, int64_t K,
                                                                        int64_t* sums) {
  for (int i = 0; i < RX * RW; ++i) sums[i] = 0;
  int64_t k = 0;
  for (; k + 32 <= K;) {
    __m512i acc[RX][RW];
    for (int i = 0; i < RX; ++i)
      for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_setzero_si512();
    for (const int64_t end = std::min(K, k + kChunk); k + 32 <= end; k += 32) {
      __m512i wv[RW];
      if constexpr (std::is_same_v<W, int8_t>)
        if ((k & 63) == 0)
          for (int j = 0; j < RW; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kStreamAhead), _MM_HINT_T0);
      for (int j = 0; j < RW; ++j) wv[j] = load32(w + j * K + k);
      for (int i = 0; i < RX; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq + i * K + k);
        for (int j = 0; j < RW; ++j) acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < RX; ++i)
      for (int j = 0; j < RW; ++j) sums[i * RW + j] += lanes_sum(acc[i][j]);
  }
  tail_sums<W, RX, RW>(xq, w, K, k, sums);
}

__attribute__((target("avx2"))) inline __m256i load16_epi16(const int8_t* w) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
__attribute__((target("avx2"))) inline __m256i load16_epi16(const int16_t* w) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
}
__attribute__((target("avx2"))) inline int64_t lanes_sum(__m256i v) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  int64_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}

// `vpmaddwd`: 16 int16 products summed in pairs into 8 int32 lanes; 16 k per step, 2
// products per lane per step: kChunk / 8 products per lane.
template <typename W, int RX, int RW>
__attribute__((target("avx2"))) void tile_avx2(const int16_t* xq, const W* w, int64_t K,
                                                int64_t* sums) {
  for (int i = 0; i < RX * RW; ++i) sums[i] = 0;
  int64_t k = 0;
  for (; k + 16 <= K;) {
    __m256i acc[RX][RW];
    for (int i = 0; i < RX; ++i)
      for (int j = 0; j < RW; ++j) acc[i][j] = _mm256_setzero_si256();
    for (const int64_t end = std::min(K, k + kChunk); k + 16 <= end; k += 16) {
      __m256i wv[RW];
      for (int j = 0; j < RW; ++j) wv[j] = load16_epi16(w + j * K + k);
      for (int i = 0; i < RX; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + k));
        for (int j = 0; j < RW; ++j)
          acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));
      }
    }
    for (int i = 0; i < RX; ++i)
      for (int j = 0; j < RW; ++j) sums[i * RW + j] += lanes_sum(acc[i][j]);
  }
  tail_sums<W, RX, RW>(xq, w, K, k, sums);
}

// A decode batch (RX <= kTileX rows of x) against one int8 weight row on AVX2, the rows
// taken one after another so the weights are read front to back, 64 k per step, with the
// bytes kStreamAhead further on requested once per cache line. On AMD Zen cores the
// hardware prefetchers do not run far enough ahead of a loop this busy (nor follow the 4
// interleaved rows of a tile): the memory wait and the arithmetic added up instead of
// overlapping (docs/performance.md, "On CPUs without AVX-512"). Same exact integer sums as
// the tiles.
template <int RX>
__attribute__((target("avx2"))) void stream_avx2(const int16_t* xq, const int8_t* w, int64_t K,
                                                  int64_t* sums) {
  for (int i = 0; i < RX; ++i) sums[i] = 0;
  int64_t k = 0;
  for (; k + 64 <= K;) {
    __m256i acc[RX][2];
    for (int i = 0; i < RX; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (const int64_t end = std::min(K, k + kChunk); k + 64 <= end; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kStreamAhead), _MM_HINT_T0);
      const __m256i w0 = load16_epi16(w + k), w1 = load16_epi16(w + k + 16),
                    w2 = load16_epi16(w + k + 32), w3 = load16_epi16(w + k + 48);
      for (int i = 0; i < RX; ++i) {
        const __m256i* x = reinterpret_cast<const __m256i*>(xq + i * K + k);
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_loadu_si256(x), w0));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_loadu_si256(x + 1), w1));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_loadu_si256(x + 2), w2));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_loadu_si256(x + 3), w3));
      }
    }
    for (int i = 0; i < RX; ++i) sums[i] += lanes_sum(_mm256_add_epi32(acc[i][0], acc[i][1]));
  }
  tail_sums<int8_t, RX, 1>(xq, w, K, k, sums);
}

void stream_rows(int64_t rx, const int16_t* xq, const int8_t* w, int64_t K, int64_t* sums) {
  switch (rx) {
    case 1: return stream_avx2<1>(xq, w, K, sums);
    case 2: return stream_avx2<2>(xq, w, K, sums);
    case 3: return stream_avx2<3>(xq, w, K, sums);
    default: return stream_avx2<kTileX>(xq, w, K, sums);
  }
}

template <typename W, int RX, int RW>
void tile(const int16_t* xq, const W* w, int64_t K, int64_t* sums) {
  switch (int8_isa()) {
    case Isa::kAmx:  // batches too small for AMX tiles
    case Isa::kVnni: return tile_vnni<W, RX, RW>(xq, w, K, sums);
    case Isa::kAvx2: return tile_avx2<W, RX, RW>(xq, w, K, sums);
    default: return tile_scalar<W, RX, RW>(xq, w, K, sums);
  }
}

template <typename W, int RX>
void tile_rw(int64_t rw, const int16_t* xq, const W* w, int64_t K, int64_t* sums) {
  switch (rw) {
    case 1: return tile<W, RX, 1>(xq, w, K, sums);
    case 2: return tile<W, RX, 2>(xq, w, K, sums);
    case 3: return tile<W, RX, 3>(xq, w, K, sums);
    default: return tile<W, RX, kTileW>(xq, w, K, sums);
  }
}

// rx rows of x (1..kTileX) against rw weight rows (1..kTileW).
template <typename W>
void any_tile(int64_t rx, int64_t rw, const int16_t* xq, const W* w, int64_t K, int64_t* sums) {
  switch (rx) {
    case 1: return tile_rw<W, 1>(rw, xq, w, K, sums);
    case 2: return tile_rw<W, 2>(rw, xq, w, K, sums);
    case 3: return tile_rw<W, 3>(rw, xq, w, K, sums);
    default: return tile_rw<W, kTileX>(rw, xq, w, K, sums);
  }
}

// out[i, j] = sums[i, j] * x_scale[i] * scale[j] + bias[j] for a block of rx x rw outputs,
// rounded to T (float or bfloat16, x's dtype): one function for every path (not inlined),
// the multiply-add written as an fma, so that -ffast-math cannot contract this float
// arithmetic differently for different paths.
template <typename T>
__attribute__((noinline)) void store_rows(int64_t rx, int64_t rw, const int64_t* sums,
                                          int64_t ld, const float* x_scale, const float* scale,
                                          const float* bias, T* out, int64_t N) {
  for (int64_t i = 0; i < rx; ++i) {
    const float xs = x_scale[i];
    for (int64_t j = 0; j < rw; ++j)
      out[i * N + j] = static_cast<T>(std::fma(static_cast<float>(sums[i * ld + j]) * xs,
                                               scale ? scale[j] : 1.f, bias ? bias[j] : 0.f));
  }
}

// out[r, n] for weight rows [begin, end) and every row r of x, kTileW weight rows at a time
// (independent accumulators, so the dot's latency overlaps): a decode step (M <= kTileX)
// dots the int8 rows as they stream in; a bigger batch widens the weight rows to int16 once
// and tiles the rows of x against them.
template <typename T>
void int8_rows(int64_t M, const int16_t* xq, const float* x_scale, const int8_t* w,
               const float* scale, const float* bias, T* out, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  int64_t sums[kTileX * kTileW];
  if (M <= kTileX && int8_isa() == Isa::kAvx2) {
    for (int64_t n = begin; n < end; ++n) {
      stream_rows(M, xq, w + n * K, K, sums);
      store_rows(M, 1, sums, 1, x_scale, scale ? scale + n : nullptr, bias ? bias + n : nullptr,
                 out + n, N);
    }
    return;
  }
  const int64_t tile_w = int8_isa() == Isa::kAvx2 ? kTileWAvx2 : kTileW;
  std::vector<int16_t> w16(M > kTileX ? kTileW * K : 0);
  for (int64_t n = begin; n < end; n += tile_w) {
    const int64_t rw = std::min(tile_w, end - n);
    if (M > kTileX)
      for (int64_t k = 0; k < rw * K; ++k) w16[k] = w[n * K + k];
    for (int64_t r = 0; r < M; r += kTileX) {
      const int64_t rx = std::min(kTileX, M - r);
      if (M > kTileX)
        any_tile(rx, rw, xq + r * K, w16.data(), K, sums);
      else
        any_tile(rx, rw, xq + r * K, w + n * K, K, sums);
      store_rows(rx, rw, sums, rw, x_scale + r, scale ? scale + n : nullptr,
                 bias ? bias + n : nullptr, out + r * N + n, N);
    }
  }
}

// ---- AMX: the same exact integer dot on the tile unit, for batches of kAmxMinRows rows on.
// AMX multiplies int8 by int8 (`tdpbssd`) or uint8 by int8 (`tdpbusd`), 16 rows x 16
// columns x 64 k per instruction, into int32. The activations are int16, so each is split
// xq = 256 * hi + lo with hi = xq >> 8 in [-128, 127] (signed) and lo = xq & 255 in
// [0, 255] (unsigned), and xq . w = 256 * (hi . w) + (lo . w): two tile products, summed
// into int64 per K chunk, the same integers as every other path (and the same floats after,
// through store_rows). Bounds: an int32 element takes 64 products per k block, each at most
// 255 * 127 = 32385, so kAmxChunk = 512 blocks (32768 k) keep it under 2^31.
//
// Both operands are laid out so that each tile is 1 KiB of contiguous bytes, and the tiles
// one k step reads sit side by side (2 KiB of x, 2 KiB of weights), which the hardware
// prefetchers follow. The weights are repacked once, at load (`int8_pack_amx`), in the
// layout a B tile takes (VNNI-4): output channels [16 nb, 16 nb + 16) at k block kb are
// 16 rows of 64 bytes, row r holding k = 64 kb + 4 r .. + 3 of each channel, 4 bytes per
// channel; the two blocks of a pair of them (2 p, 2 p + 1) sit together per kb:
// [N32 / 32, K64 / 64, 2, 16, 64] int8 (N padded to 32 and K to 64 with zeros: as many
// bytes as the weight plus the padding). x per call: [M16 / 16, K64 / 64, (hi, lo), 16, 64].
constexpr int64_t kAmxMinRows = 4;    // AMX from here on (padded to 16 rows, it beat VNNI
                                      // from 4 rows, tied at 2: docs/performance.md)
constexpr int64_t kAmxChunk = 512;    // k blocks of 64 per int32 accumulation
constexpr int64_t kAmxCols = 32;      // output channels per tile step (2 tiles of 16)
constexpr int64_t kAmxRowChunk = 64;  // rows of x per pass over the weights

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

#ifdef CONVEYOR_AMX
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: int32 sums (hi.w0, lo.w0, hi.w1, lo.w1); 4, 5: hi and lo of 16 rows of x;
// 6, 7: two column blocks of weights. All 16 rows x 64 bytes. A constant in memory: GCC
// drops the stores into a local one (it does not see that ldtilecfg reads them).
constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                    {16, 16, 16, 16, 16, 16, 16, 16}};

// Both AMX kernels' layout (int8 and bf16 tiles alike are 16 rows x 64 bytes).
__attribute__((target("amx-tile"))) void amx_configure() { _tile_loadconfig(&kTileConfig); }

__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// sums[16, 32] (row stride kAmxCols) = the dots of 16 rows of x (a: their Kb k blocks of
// hi and lo) with a pair of column blocks (b: their Kb k blocks), one k chunk at a time.
__attribute__((target("amx-tile,amx-int8"))) void amx_dots(const uint8_t* a, const int8_t* b,
                                                           int64_t Kb, int64_t* sums) {
  alignas(64) int32_t c[4][16 * 16];
  std::fill(sums, sums + 16 * kAmxCols, 0);
  for (int64_t begin = 0; begin < Kb; begin += kAmxChunk) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = begin; kb < std::min(Kb, begin + kAmxChunk); ++kb) {
      _tile_loadd(4, a + kb * 2048, 64);         // hi
      _tile_loadd(5, a + kb * 2048 + 1024, 64);  // lo
      _tile_loadd(6, b + kb * 2048, 64);
      _tile_loadd(7, b + kb * 2048 + 1024, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbusd(1, 5, 6);
      _tile_dpbssd(2, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        sums[i * kAmxCols + j] +=
            256 * static_cast<int64_t>(c[0][i * 16 + j]) + c[1][i * 16 + j];
        sums[i * kAmxCols + 16 + j] +=
            256 * static_cast<int64_t>(c[2][i * 16 + j]) + c[3][i * 16 + j];
      }
  }
}
#endif

// out for the column pairs [begin, end) (kAmxCols channels each) and all M rows of x
// (xt: laid out as above).
template <typename T>
void int8_rows_amx(int64_t M, const uint8_t* xt, int64_t Kb, const float* x_scale,
                   const int8_t* packed, const float* scale, const float* bias, T* out,
                   int64_t N, int64_t begin, int64_t end) {
#ifdef CONVEYOR_AMX
  int64_t sums[16 * kAmxCols];
  amx_configure();  // per thread: the tile configuration is thread state
  for (int64_t rows = 0; rows < M; rows += kAmxRowChunk)  // x's chunk stays in cache
    for (int64_t p = begin; p < end; ++p) {  // and the pair's weights over the chunk
      const int64_t n = p * kAmxCols;
      for (int64_t r = rows; r < std::min(M, rows + kAmxRowChunk); r += 16) {
        amx_dots(xt + r / 16 * Kb * 2048, packed + p * Kb * 2048, Kb, sums);
        store_rows(std::min<int64_t>(16, M - r), std::min(kAmxCols, N - n), sums, kAmxCols,
                   x_scale + r, scale ? scale + n : nullptr, bias ? bias + n : nullptr,
                   out + r * N + n, N);
      }
    }
  amx_release();
#else
  TORCH_CHECK(false, "int8_rows_amx: built without AMX");
#endif
}

// x [M, K] and out [M, N] in T (float or bfloat16: read and written directly, no casts).
template <typename T>
void int8_linear(int64_t M, const T* x, const int8_t* w, const int8_t* packed,
                 const float* scale, const float* bias, T* out, int64_t K, int64_t N) {
  const bool amx = packed != nullptr && int8_isa() == Isa::kAmx && M >= kAmxMinRows;
  const int64_t Kp = round_up(K, 64);
  std::vector<int16_t> xq(amx ? 0 : M * K);
  std::vector<uint8_t> xt(amx ? round_up(M, 16) * Kp * 2 : 0);  // zero padding adds nothing
  std::vector<float> x_scale(M);  // amax / 32767 of each row
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t begin, int64_t end) {
    std::vector<int16_t> row(K);
    for (int64_t r = begin; r < end; ++r) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k)
        amax = std::max(amax, std::abs(static_cast<float>(x[r * K + k])));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* q = amx ? row.data() : xq.data() + r * K;
      for (int64_t k = 0; k < K; ++k)
        q[k] = static_cast<int16_t>(std::nearbyint(static_cast<float>(x[r * K + k]) * inv));
      x_scale[r] = amax / 32767.f;
      if (amx)  // row r % 16 of the hi and lo tiles of each k block, 64 bytes each
        for (int64_t kb = 0; kb * 64 < K; ++kb) {
          uint8_t* hi = xt.data() + (r / 16 * (Kp / 64) + kb) * 2048 + r % 16 * 64;
          uint8_t* lo = hi + 1024;
          const int16_t* block = q + kb * 64;
          const int64_t n = std::min<int64_t>(64, K - kb * 64);
          for (int64_t i = 0; i < n; ++i) {  // contiguous: the compiler vectorizes it
            hi[i] = static_cast<uint8_t>(block[i] >> 8);
            lo[i] = static_cast<uint8_t>(block[i] & 0xff);
          }
        }
    }
  });
  if (amx) {
    at::parallel_for(0, round_up(N, kAmxCols) / kAmxCols, 1, [&](int64_t begin, int64_t end) {
      int8_rows_amx(M, xt.data(), Kp / 64, x_scale.data(), packed, scale, bias, out, N, begin,
                    end);
    });
    return;
  }
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    int8_rows(M, xq.data(), x_scale.data(), w, scale, bias, out, K, N, begin, end);
  });
}

// ---- AMX-BF16: bfloat16 matmuls of kMaxRows + 1 to kAmxBf16MaxRows rows (decode batches
// and the default 512-token prefill steps) on the tile unit, where oneDNN's packed GEMM
// took 1.1-1.5x the time at 8-128 rows (SmolLM2's decode matmuls, cold weights,
// docs/performance.md "bfloat16 on AVX512-BF16 and AMX tiles"). `tdpbf16ps` multiplies 16 rows x 32 k of x
// by 32 k x 16 columns of weights into float32 sums, each product exact; a row's sums never
// depend on the other rows, so a request's result is the same in any batch of this range.
// Weights are repacked once, at load (`bf16_pack_amx`), in the layout a B tile takes: for
// output channels [16 c, 16 c + 16) and k block kb (32 k), 16 rows of 64 bytes, row r
// holding k = 32 kb + 2 r and + 1 of each channel; the two column blocks of a pair sit
// together per kb: [N32 / 32, K32 / 32, 2, 16, 32] bfloat16 (zero padded). x is read in
// place (its rows padded to 32 and K to 32 in a copy where needed): an A tile is 16 rows of
// x at their own stride. Tiles 0-3: the sums of 2 row blocks x 2 column blocks; 4, 5: x;
// 6, 7: weights.
constexpr int64_t kAmxBf16MaxRows = 512;
constexpr int64_t kAmxBf16Ahead = 2;  // k blocks (4 KiB of a pair's weights) asked for ahead

#if defined(CONVEYOR_AMX) && defined(CONVEYOR_BF16_DOT)
// c [32, 32] float32 = 32 rows of x (row stride Kp) . a column pair's Kb k blocks (b); the
// first pass over a pair asks for its weights ahead (later ones find them in cache).
__attribute__((target("amx-tile,amx-bf16"))) void amx_bf16_dots(const uint16_t* x, int64_t Kp,
                                                                 const uint16_t* b, int64_t Kb,
                                                                 float* c, bool ask_ahead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < Kb; ++kb) {
    if (ask_ahead) {
      const char* ahead = reinterpret_cast<const char*>(b + (kb + kAmxBf16Ahead) * 1024);
      for (int64_t line = 0; line < 2048; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    _tile_loadd(4, x + kb * 32, Kp * 2);
    _tile_loadd(6, b + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + kb * 1024 + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, x + 16 * Kp + kb * 32, Kp * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 512, 128);
  _tile_stored(3, c + 528, 128);
}

// out [rows, cols] (row stride N) = c * scale + bias, rounded to bfloat16 as torch rounds.
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) void amx_bf16_store(
    const float* c, int64_t rows, int64_t cols, const float* scale, const float* bias,
    at::BFloat16* out, int64_t N) {
  alignas(64) float s[32], b[32];
  for (int64_t j = 0; j < 32; ++j) {
    s[j] = scale && j < cols ? scale[j] : 1.f;
    b[j] = bias && j < cols ? bias[j] : 0.f;
  }
  const __mmask16 lo_mask = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __mmask16 hi_mask = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_fmadd_ps(_mm512_load_ps(c + r * 32), _mm512_load_ps(s),
                                      _mm512_load_ps(b));
    const __m512 hi = _mm512_fmadd_ps(_mm512_load_ps(c + r * 32 + 16), _mm512_load_ps(s + 16),
                                      _mm512_load_ps(b + 16));
    _mm256_mask_storeu_epi16(out + r * N, lo_mask, (__m256i)_mm512_cvtneps_pbh(lo));
    _mm256_mask_storeu_epi16(out + r * N + 16, hi_mask, (__m256i)_mm512_cvtneps_pbh(hi));
  }
}
#endif

// out [M, N] = x [M, Kp] (rows padded to 32) . the packed weights, for the column pairs
// [begin, end): each pair's weights (Kb x 2 KiB) stay in cache across x's row pairs.
void amx_bf16_rows(int64_t M, const uint16_t* x, int64_t Kp, const uint16_t* packed,
                   const float* scale, const float* bias, at::BFloat16* out, int64_t N,
                   int64_t begin, int64_t end) {
#if defined(CONVEYOR_AMX) && defined(CONVEYOR_BF16_DOT)
  alignas(64) float c[32 * 32];
  const int64_t Kb = Kp / 32;
  amx_configure();  // per thread: the tile configuration is thread state
  for (int64_t p = begin; p < end; ++p) {
    const int64_t n = p * 32;
    for (int64_t r = 0; r < M; r += 32) {
      amx_bf16_dots(x + r * Kp, Kp, packed + p * Kb * 1024, Kb, c, r == 0);
      amx_bf16_store(c, std::min<int64_t>(32, M - r), std::min<int64_t>(32, N - n),
                     scale ? scale + n : nullptr, bias ? bias + n : nullptr, out + r * N + n, N);
    }
  }
  amx_release();
#else
  TORCH_CHECK(false, "amx_bf16_rows: built without AMX-BF16");
#endif
}

}  // namespace

// The AMX copy of int8 weights [N, K] (layout above), or an undefined tensor where this
// CPU has no AMX-INT8.
torch::Tensor int8_pack_amx(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && !weight.is_cuda(),
              "int8_pack_amx: int8 CPU weights [N, K] expected");
  if (!has_amx()) return {};
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kb = round_up(K, 64) / 64;
  auto packed = torch::zeros({round_up(N, kAmxCols) / 32, Kb, 2, 16, 64}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k)  // pair n / 32, block k / 64, half n / 16 % 2, row k % 64
        dst[(((n / 32 * Kb + k / 64) * 2 + n / 16 % 2) * 16 + k % 64 / 4) * 64 +  // / 4, byte
            n % 16 * 4 + k % 4] = src[n * K + k];                                 // 4 c + k % 4
  });
  return packed;
}

// The AMX-BF16 copy of bfloat16 weights [N, K] (layout above), or an undefined tensor where
// this CPU has no AMX-BF16.
torch::Tensor bf16_pack_amx(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && !weight.is_cuda(),
              "bf16_pack_amx: bfloat16 CPU weights [N, K] expected");
  if (!has_amx_bf16()) return {};
  const torch::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), Kb = round_up(K, 32) / 32;
  auto packed = torch::zeros({round_up(N, 32) / 32, Kb, 2, 16, 32}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k)  // pair n / 32, block k / 32, half n / 16 % 2, row k % 32 / 2
        dst[(((n / 32 * Kb + k / 32) * 2 + n / 16 % 2) * 16 + k % 32 / 2) * 32 + n % 16 * 2 +
            k % 2] = src[n * K + k];
  });
  return packed;
}

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& scale,
                           const c10::optional<torch::Tensor>& bias,
                           const c10::optional<torch::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [M, K] and weight [N, K] expected");
  const bool int8 = weight.scalar_type() == at::kChar;
  const bool amx_bf16 = weight.scalar_type() == at::kBFloat16 && packed.has_value() &&
                        packed->defined() && x.size(0) > kMaxRows;
  TORCH_CHECK(x.size(0) >= 1 && (x.size(0) <= kMaxRows || int8 ||
                                 (amx_bf16 && x.size(0) <= kAmxBf16MaxRows)),
              "small_linear: 1 to ", kMaxRows, " rows (any number for int8 weights, up to ",
              kAmxBf16MaxRows, " with bf16_pack_amx's copy of bfloat16 ones), got ", x.size(0));
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  weight.is_contiguous(),
              "small_linear: float32 or bfloat16 x and a contiguous weight");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* scale_ptr = nullptr;
  const float* bias_ptr = nullptr;
  // casts here rather than in Python: each costs a dispatch there, per matmul
  torch::Tensor scale_f, bias_f;
  if (scale.has_value() && scale->defined()) {
    scale_f = scale->to(at::kFloat).contiguous();
    TORCH_CHECK(scale_f.numel() == N, "small_linear: scale must be [N]");
    scale_ptr = scale_f.data_ptr<float>();
  }
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_f.numel() == N, "small_linear: bias must be [N]");
    bias_ptr = bias_f.data_ptr<float>();
  }
  if (int8) {  // x and out in x's dtype
    const int8_t* packed_ptr = nullptr;
    if (packed.has_value() && packed->defined()) {
      TORCH_CHECK(packed->scalar_type() == at::kChar && packed->is_contiguous() &&
                      packed->numel() == round_up(N, kAmxCols) * round_up(K, 64),
                  "small_linear: packed must be int8_pack_amx(weight)");
      packed_ptr = packed->data_ptr<int8_t>();
    }
    const torch::Tensor xc = x.contiguous();
    auto out = torch::empty({M, N}, xc.options());
    if (x.scalar_type() == at::kFloat)
      int8_linear(M, xc.data_ptr<float>(), weight.data_ptr<int8_t>(), packed_ptr, scale_ptr,
                  bias_ptr, out.data_ptr<float>(), K, N);
    else
      int8_linear(M, xc.data_ptr<at::BFloat16>(), weight.data_ptr<int8_t>(), packed_ptr,
                  scale_ptr, bias_ptr, out.data_ptr<at::BFloat16>(), K, N);
    return out;
  }
  if (amx_bf16) {  // bfloat16 x [M, K] -> out [M, N] bfloat16, on the tile unit
    TORCH_CHECK(has_amx_bf16(), "small_linear: this CPU has no AMX-BF16 for packed");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed->scalar_type() == at::kBFloat16 &&
                    packed->is_contiguous() && packed->numel() == round_up(N, 32) * round_up(K, 32),
                "small_linear: packed must be bf16_pack_amx(weight), x bfloat16");
    const int64_t Kp = round_up(K, 32), Mp = round_up(M, 32);
    torch::Tensor xa = x.contiguous();
    if (Mp != M || Kp != K) {  // zero rows and k add nothing
      xa = torch::zeros({Mp, Kp}, x.options());
      xa.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
    }
    auto out = torch::empty({M, N}, x.options());
    const auto* xp = reinterpret_cast<const uint16_t*>(xa.data_ptr());
    const auto* bp = reinterpret_cast<const uint16_t*>(packed->data_ptr());
    at::BFloat16* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, round_up(N, 32) / 32, 1, [&](int64_t begin, int64_t end) {
      amx_bf16_rows(M, xp, Kp, bp, scale_ptr, bias_ptr, op, N, begin, end);
    });
    return out;
  }
#ifdef CONVEYOR_BF16_DOT
  if (weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 &&
      bf16_dot_enabled()) {
    const torch::Tensor xc = x.contiguous();
    auto out = torch::empty({M, N}, xc.options().dtype(at::kFloat));
    run_bf16(M, reinterpret_cast<const uint16_t*>(xc.data_ptr()),
             reinterpret_cast<const uint16_t*>(weight.data_ptr()), scale_ptr, bias_ptr,
             out.data_ptr<float>(), K, N);
    return out.to(at::kBFloat16);
  }
#endif
  const torch::Tensor x_f = x.to(at::kFloat).contiguous();
  auto out = torch::empty({M, N}, x_f.options());
  const float* xp = x_f.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat:
      run(M, xp, weight.data_ptr<float>(), scale_ptr, bias_ptr, op, K, N);
      break;
    case at::kBFloat16:
      run(M, xp, reinterpret_cast<const uint16_t*>(weight.data_ptr()), scale_ptr, bias_ptr, op, K, N);
      break;
    default:
      TORCH_CHECK(false, "small_linear: float32, bfloat16 or int8 weights, got ",
                  weight.scalar_type());
  }
  return out.to(x.scalar_type());
}

// ------------------------------------------------------------------ fused elementwise ops
// Float32 math whatever the storage dtype (float32 or bfloat16), in HF transformers' order:
// RMSNorm computes in float32 and rounds x * rsqrt(mean(x^2) + eps) to the dtype before
// the weight multiplies it.

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* delta, const T* weight, T* sum_out, T* out, int64_t rows,
                   int64_t hidden, double eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      float sq = 0.f;
      if (delta != nullptr) {  // residual add first, rounded to the dtype as torch would
        const T* dr = delta + r * hidden;
        T* sr = sum_out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
          row[i] = static_cast<float>(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(xr[i]);
      }
#pragma omp simd reduction(+ : sq)
      for (int64_t i = 0; i < hidden; ++i) sq += row[i] * row[i];
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sq) / hidden + eps));
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = static_cast<T>(static_cast<float>(weight[i]) *
                              static_cast<float>(static_cast<T>(row[i] * inv)));
    }
  });
}

// exp's argument is capped at kMaxSiluExp: for x < -88.7 exp(-x) overflowed to inf, and
// this code (built with -ffast-math) made NaN of x / inf where torch gives -0. Capped, x <
// -88 gives x / e^88 (below 1e-34 for |x| < 1e4; torch: ~1e-37, then 0).
constexpr float kMaxSiluExp = 88.f;

#if defined(__AVX512F__)
inline __m512 silu16(__m512 v) {
  const __m512 neg = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(v), _mm512_castps_si512(_mm512_set1_ps(-0.f))));
  const __m512 e = Sleef_expf16_u10(_mm512_min_ps(neg, _mm512_set1_ps(kMaxSiluExp)));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#endif

// silu(x) = x / (1 + exp(-x)) over n floats, as torch's CPU silu computes it: with SLEEF's
// vector exp (1.0 ULP; torch links it) on AVX-512 and AVX2, so that every element of a row
// of any batch gets the same bits (a tail goes through a masked or padded vector) and a
// prefill's rows do not pay a scalar exp per element (with AMX bf16 matmuls, the scalar
// loop took 12-20 % of a prefill step).
void silu(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, silu16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, mask, silu16(_mm512_maskz_loadu_ps(mask, x + i)));
  }
  return;
#elif defined(__AVX2__)
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 cap = _mm256_set1_ps(kMaxSiluExp);
  auto silu8 = [&](__m256 v) {
    const __m256 e = Sleef_expf8_u10(_mm256_min_ps(_mm256_xor_ps(v, sign), cap));  // exp(-x)
    return _mm256_div_ps(v, _mm256_add_ps(one, e));
  };
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, silu8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    float tail[8] = {0.f};
    std::copy(x + i, x + n, tail);
    _mm256_storeu_ps(tail, silu8(_mm256_loadu_ps(tail)));
    std::copy(tail, tail + (n - i), out + i);
  }
  return;
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.f + std::exp(std::min(-x[i], kMaxSiluExp)));
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / inter), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(inter), act(inter);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate_row = gate_up + r * 2 * inter;
      const T* up_row = gate_row + inter;
      for (int64_t c = 0; c < inter; ++c) gate[c] = static_cast<float>(gate_row[c]);
      silu(gate.data(), act.data(), inter);
      T* dst = out + r * inter;
      for (int64_t c = 0; c < inter; ++c)  // torch's silu rounded to T, then * up, rounded
        dst[c] = static_cast<T>(static_cast<float>(static_cast<T>(act[c])) *
                                static_cast<float>(up_row[c]));
    }
  });
}

// Rotate one head [D] by the angles of a position: x * cos + rotate_half(x) * sin.
template <typename T>
inline void rope_head(const T* x, const float* cos, const float* sin, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = static_cast<float>(x[i]);
    const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
    const float c = static_cast<float>(static_cast<T>(cos[i]));  // the tables in the dtype
    const float s = static_cast<float>(static_cast<T>(sin[i]));
    out[i] = static_cast<T>(static_cast<float>(static_cast<T>(v * c)) +
                            static_cast<float>(static_cast<T>(rotated * s)));
  }
}

template <typename T>
void rope_write_kv_rows(const T* qkv, const float* cos_table, const float* sin_table,
                        const int64_t* positions, const int64_t* slots, T* k_cache, T* v_cache,
                        T* q_out, int64_t rows, int64_t num_heads, int64_t num_kv_heads,
                        int64_t dim, int64_t num_positions, int64_t num_slots) {
  const int64_t row_stride = (num_heads + 2 * num_kv_heads) * dim, kv_row = num_kv_heads * dim;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // an out-of-range position or slot would read or write outside the tables
      TORCH_CHECK(positions[r] >= 0 && positions[r] < num_positions,
                  "rope_write_kv: position ", positions[r], " is outside the RoPE table");
      TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "rope_write_kv: slot ", slots[r],
                  " is outside the KV cache");
      const T* src = qkv + r * row_stride;
      const float* cos = cos_table + positions[r] * dim;
      const float* sin = sin_table + positions[r] * dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_head(src + h * dim, cos, sin, dim, q_out + (r * num_heads + h) * dim);
      T* k_dst = k_cache + slots[r] * kv_row;
      for (int64_t h = 0; h < num_kv_heads; ++h)
        rope_head(src + (num_heads + h) * dim, cos, sin, dim, k_dst + h * dim);
      std::copy(src + (num_heads + num_kv_heads) * dim, src + row_stride, v_cache + slots[r] * kv_row);
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && !t.is_cuda(), name,
              ": a contiguous 2-D CPU tensor expected");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 expected, got ", t.scalar_type());
}

}  // namespace

// ---------------------------------------------------------------------------- argmax
// Each row's first maximum, a NaN counting as the largest (torch's and numpy's argmax): on
// bfloat16 logits too, which torch's CPU argmax took 5.4 ms for at 64 x 49152 and widening
// them to float32 for numpy's ~1 ms (a greedy 64-request step's logits, AMX Xeon). Two
// passes a row: the maximum (the compiler vectorizes the reduction; NaNs by their bits, since
// the kernels are built with -ffast-math), then its first index.
namespace {

inline bool is_nan(float v) {
  return (__builtin_bit_cast(uint32_t, v) & 0x7fffffffu) > 0x7f800000u;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 m0 = _mm512_set1_ps(best), m1 = m0;
  const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
  __mmask16 nans = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(a), abs_bits), inf_bits);
    nans |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(b), abs_bits), inf_bits);
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  best = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    const float v = widen(x[i]);
    nan |= is_nan(v);
    best = std::max(best, v);
  }
  i = 0;
#ifdef __AVX512F__
  if (!nan) {
    const __m512 target = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(load16(x + i), target, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = widen(x[i]);
    if (nan ? is_nan(v) : v == best) return i;
  }
  return 0;  // every element -inf
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && !x.is_cuda() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "argmax_rows: float32 or bfloat16 CPU logits [N, V] expected");
  const torch::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: empty rows");
  auto out = torch::empty({rows}, xc.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const auto* bp = bf16 ? reinterpret_cast<const uint16_t*>(xc.data_ptr()) : nullptr;
  const float* fp = bf16 ? nullptr : xc.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      op[r] = bf16 ? argmax_row(bp + r * n, n) : argmax_row(fp + r * n, n);
  });
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1) &&
                  weight.is_contiguous(), "rms_norm: weight must be [hidden] in x's dtype");
  auto out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), nullptr,
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                      const torch::Tensor& delta,
                                                      const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1) &&
                  weight.is_contiguous(), "add_rms_norm: x, delta [T, hidden] and weight [hidden] in one dtype");
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                            weight.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), eps);
  });
  return {sum, out};
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: [T, 2 * intermediate] expected");
  const int64_t inter = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            gate_up.size(0), inter);
  });
  return out;
}

torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos_table,
                            const torch::Tensor& sin_table, const torch::Tensor& positions,
                            torch::Tensor& k_cache, torch::Tensor& v_cache,
                            const torch::Tensor& slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads) {
  check_rows(qkv, "rope_write_kv");
  const int64_t rows = qkv.size(0), dim = cos_table.size(1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim,
              "rope_write_kv: qkv must be [T, (Hq + 2 Hkv) * D]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  sin_table.sizes() == cos_table.sizes(),
              "rope_write_kv: contiguous float32 cos/sin tables [P, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == rows && slot_mapping.numel() == rows &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_write_kv: int64 positions and slot_mapping [T]");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == num_kv_heads &&
                  k_cache.size(3) == dim,
              "rope_write_kv: caches [N, bs, Hkv, D] in qkv's dtype");
  auto q = torch::empty({rows, num_heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos_table.data_ptr<float>(),
                                 sin_table.data_ptr<float>(), positions.data_ptr<int64_t>(),
                                 slot_mapping.data_ptr<int64_t>(), k_cache.data_ptr<scalar_t>(),
                                 v_cache.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), rows,
                                 num_heads, num_kv_heads, dim, cos_table.size(0),
                                 k_cache.size(0) * k_cache.size(1));
  });
  return q;
}

// ------------------------------------------------------------------ decode attention
// One query token per sequence, its context read in place from the paged float32 or
// bfloat16 KV cache (each element widened as it is read), softmax in float32. The context
// is read a block at a time, all the work item's KV heads of a block before the next
// block, with the next block asked for ahead (`prefetch_block`): a block is one contiguous
// run of memory ([block_size, Hkv, D]), so it streams, where a walk of one KV head's rows
// through the blocks waited on each row's load (docs/performance.md, "Decode attention a
// block at a time"). A work item is one sequence with all its KV heads, or, when there are
// fewer sequences than threads (one request), one (sequence, KV head), so its heads spread
// over the threads. Both give the same bits: per (sequence, KV head) the same operations
// in the same order. head_dim 64 with up to 4 query heads per KV head (SmolLM2) runs vector
// kernels, AVX-512 or AVX2; other shapes the plain loops. attention/csrc/paged_decode.cpp is the float32 kernel where this file
// does not build; without this one a bfloat16 cache took torch's reference path.

namespace {

constexpr float kMinExponent = -30.f;

// Whether the vector kernels ask for the current block's value rows while they read its
// key rows (see attend), and which cache their row requests fill (`prefetch_row`'s
// Locality): measured on AVX-512 only (into L2: 0.7-0.9x the time of into L1 there).
#if defined(__AVX512F__)
constexpr bool kValuesEarly = true;
constexpr int kRowLocality = 2;
#else
constexpr bool kValuesEarly = false;
constexpr int kRowLocality = 3;
#endif

template <typename T>
inline float dot_widen(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * widen(b[i]);
  return acc;
}

template <typename T>
inline void axpy_widen(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * widen(x[i]);
}

// Asks the cache for `bytes` from p, a line at a time (a hint: never faults).
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
}

// Asks the cache for one row of 64 elements at p (a hint: never faults); `Locality` 3 into
// L1, 2 and 1 into L2 (prefetcht1, prefetcht2).
template <int Locality = 3, typename T>
inline void prefetch_row(const T* p) {
  for (int64_t b = 0; b < 64 * int64_t(sizeof(T)); b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, Locality);
}

// The rows the scores kernels ask for as they read key row t: the next block's key row and
// this block's value row, where given.
template <typename T>
inline void prefetch_rows(const T* next, const T* values, int64_t offset) {
  if (next) prefetch_row<kRowLocality>(next + offset);
  if (values) prefetch_row<kRowLocality>(values + offset);
}

#if defined(__AVX512F__)
// head_dim 64 (SmolLM2), up to 4 query heads per KV head: the KV head's query rows (and
// then its output rows) stay in registers while a block's rows stream past, each key and
// value row loaded (and widened) once for all of them (the plain loops below re-read a row
// for every query head and keep the output in memory). Rows are `stride` elements apart.
template <int G, typename T>
void scores_d64(const float* query, const T* k, int64_t n, int64_t stride, float scale,
                float* scores, int64_t len, const T* next, const T* values) {
  // query [G, 64] -> scores[g * len + t], t < n; next, values: rows to ask the cache for
  // (prefetch_rows), or null
  __m512 qv[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(query + g * 64 + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const T* key = k + t * stride;
    prefetch_rows(next, values, t * stride);
    const __m512 k0 = load16(key), k1 = load16(key + 16), k2 = load16(key + 32),
                 k3 = load16(key + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 a = _mm512_fmadd_ps(qv[g][0], k0, _mm512_mul_ps(qv[g][1], k1));
      const __m512 b = _mm512_fmadd_ps(qv[g][2], k2, _mm512_mul_ps(qv[g][3], k3));
      scores[g * len + t] = scale * _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  }
}

template <int G, typename T>
void values_d64(const float* probs, const T* v, int64_t n, int64_t stride, float* out,
                int64_t len, const T* next, const T* upcoming) {
  // out [G, 64] += sum over t < n of probs[g * len + t] v_t; next as in scores_d64;
  // upcoming: rows of the thread's next item asked for into L2 (attend's `next_item`)
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(out + g * 64 + c * 16);
  for (int64_t t = 0; t < n; ++t) {
    const T* value = v + t * stride;
    if (next) prefetch_row(next + t * stride);
    if (upcoming) prefetch_row<2>(upcoming + t * stride);
    const __m512 v0 = load16(value), v1 = load16(value + 16), v2 = load16(value + 32),
                 v3 = load16(value + 48);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * len + t]);
      acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + g * 64 + c * 16, acc[g][c]);
}

#elif defined(__AVX2__)
// The same for AVX2 (8 lanes, 16 registers): G query rows of 8 vectors do not fit in
// registers beside a key row, so the query is read from L1 for each key row, and the lane
// sums of 8 keys' partial products are summed together (`lane_sums`) instead of one
// horizontal sum per score. Without these, the plain loops ran the attention at 4-7 GB/s,
// a fifth of what an AVX2 EPYC reads (docs/performance.md, "Decode attention on AVX2").

// out[i] = the sum of p[i]'s 8 lanes, i < 8.
inline __m256 lane_sums(const __m256* p) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(p[0], p[1]), _mm256_hadd_ps(p[2], p[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(p[4], p[5]), _mm256_hadd_ps(p[6], p[7]));
  // a = [p0..p3 over lanes 0-3 | p0..p3 over lanes 4-7], b the same for p4..p7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <int G, typename T>
void scores_d64(const float* query, const T* k, int64_t n, int64_t stride, float scale,
                float* scores, int64_t len, const T* next, const T* values) {
  // query [G, 64] -> scores[g * len + t], t < n; next, values as in the AVX-512 kernel
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - t0);
    __m256 part[G][8];
    for (int64_t i = 0; i < m; ++i) {
      const T* key = k + (t0 + i) * stride;
      prefetch_rows(next, values, (t0 + i) * stride);
      __m256 kr[8];
      for (int c = 0; c < 8; ++c) kr[c] = load8(key + c * 8);
      for (int g = 0; g < G; ++g) {
        const float* q = query + g * 64;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), kr[0]);
        __m256 b = _mm256_mul_ps(_mm256_loadu_ps(q + 8), kr[1]);
        for (int c = 2; c < 8; c += 2) {
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8), kr[c], a);
          b = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 8 + 8), kr[c + 1], b);
        }
        part[g][i] = _mm256_add_ps(a, b);
      }
    }
    for (int64_t i = m; i < 8; ++i)
      for (int g = 0; g < G; ++g) part[g][i] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      const __m256 r = _mm256_mul_ps(s, lane_sums(part[g]));
      if (m == 8) {
        _mm256_storeu_ps(scores + g * len + t0, r);
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, r);
        std::copy(tail, tail + m, scores + g * len + t0);
      }
    }
  }
}

template <int G, typename T>
void values_d64(const float* probs, const T* v, int64_t n, int64_t stride, float* out,
                int64_t len, const T* next, const T* upcoming) {
  // out [G, 64] += sum over t < n of probs[g * len + t] v_t; next, upcoming as in the
  // AVX-512 kernel
  constexpr int C = 4;  // vectors of a row per pass: G x C accumulators in registers
  for (int d0 = 0; d0 < 64; d0 += C * 8) {
    __m256 acc[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm256_loadu_ps(out + g * 64 + d0 + c * 8);
    for (int64_t t = 0; t < n; ++t) {
      const T* value = v + t * stride + d0;
      if (next && d0 == 0) prefetch_row(next + t * stride);
      if (upcoming && d0 == 0) prefetch_row<2>(upcoming + t * stride);
      __m256 vr[C];
      for (int c = 0; c < C; ++c) vr[c] = load8(value + c * 8);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_broadcast_ss(probs + g * len + t);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm256_fmadd_ps(p, vr[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + g * 64 + d0 + c * 8, acc[g][c]);
  }
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
template <typename F>
void with_group(int64_t group, F&& f) {  // f(std::integral_constant<int, G>), G = group <= 4
  switch (group) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}
#endif

// The item a thread attends after this one (`attend`'s `next_item`): its first blocks.
struct NextItem {
  const int32_t* blocks = nullptr;  // its block ids, from its first block on
  int64_t num_blocks = 0, kv_begin = 0;
};

// The cache's shape and the step's tables, as the kernel reads them.
struct PagedContext {
  int64_t num_blocks, block_size, head_dim, group, token_stride, block_stride, max_blocks;
  const int32_t* tables;
  const int32_t* lens;
};

// Sequence `seq`'s KV heads [kv_begin, kv_end) over its blocks [b_begin, b_end): query
// [(kv_end - kv_begin) * G, D] (their query heads, in order) -> out of the same shape. k, v:
// the caches. With `stats` null, all of the context's blocks and out the attention itself.
// Else one partition of the context: out the partition's values weighted by exp(score - its
// max score), not yet divided by their sum, and stats [heads, 2] that max and that sum
// (`merge_partitions` combines the partitions). While the values pass reads this item's
// value rows (from L2 on AVX-512, where the scores pass asked for them), it asks for the key
// rows of `next_item`, the thread's next: memory went idle there, between two items' reads
// (0.78-0.92x the attention's time, docs/performance.md "The next item's keys").
template <typename T>
void attend(const PagedContext& ctx, int64_t seq, int64_t kv_begin, int64_t kv_end,
            int64_t b_begin, int64_t b_end, const float* query, const T* k, const T* v,
            float scale, std::vector<float>& scores, float* out, float* stats,
            const NextItem& next_item) {
  const int64_t seq_len = ctx.lens[seq], bs = ctx.block_size, D = ctx.head_dim, G = ctx.group;
  const int64_t heads = (kv_end - kv_begin) * G, num_used = (seq_len + bs - 1) / bs;
  TORCH_CHECK(num_used <= ctx.max_blocks, "decode_attention: seq_len beyond the block table");
  const int32_t* table = ctx.tables + seq * ctx.max_blocks;
  for (int64_t b = b_begin; b < b_end; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < ctx.num_blocks, "decode_attention: bad block id");
  const int64_t len = std::min(b_end * bs, seq_len) - b_begin * bs;  // the range's tokens
  const int64_t block_bytes = ctx.block_stride * static_cast<int64_t>(sizeof(T));
  auto block = [&](const T* cache, int64_t b) { return cache + table[b] * ctx.block_stride; };
  bool fast = false;
#if defined(__AVX512F__) || defined(__AVX2__)
  fast = D == 64 && G <= 4;
#endif
  // The plain loops ask for the next block whole, before a block's work; the vector kernels
  // a row at a time as they go (`next`), and with AVX-512 the block's value rows too while
  // they read its keys (`values`), so the values pass finds them in L2 (where the AVX-512
  // build sends its row requests: kRowLocality). The whole-block burst stalls while the
  // core's miss queue drains: spread out, the requests took 0.76-0.93x the time on an AVX2
  // EPYC, 0.66-0.93x (with the values) on an AVX-512 one, and into L2 0.7-0.9x that again
  // (docs/performance.md, "Decode attention on AVX2", "... on AVX-512, rows at a time").
  const bool values_early = fast && kValuesEarly;
  // (past the range's end too: a sequence's next partition is mostly the same thread's next)
  auto ahead = [&](const T* cache, int64_t b, int64_t kv) -> const T* {
    return fast && b + 1 < num_used ? block(cache, b + 1) + kv * D : nullptr;
  };
  scores.resize(heads * len);  // [heads, len]
  prefetch_block(block(k, b_begin), block_bytes);
  for (int64_t b = b_begin; b < b_end; ++b) {
    if (b + 1 < b_end && !fast) prefetch_block(block(k, b + 1), block_bytes);
    const int64_t t0 = (b - b_begin) * bs, n = std::min(bs, len - t0);
    for (int64_t kv = kv_begin; kv < kv_end; ++kv) {
      const T* rows = block(k, b) + kv * D;
      const float* q = query + (kv - kv_begin) * G * D;
      float* sc = scores.data() + (kv - kv_begin) * G * len + t0;
#if defined(__AVX512F__) || defined(__AVX2__)
      if (fast) {
        with_group(G, [&](auto g) {
          scores_d64<decltype(g)::value>(q, rows, n, ctx.token_stride, scale, sc, len,
                                         ahead(k, b, kv),
                                         values_early ? block(v, b) + kv * D : nullptr);
        });
        continue;
      }
#endif
      for (int64_t t = 0; t < n; ++t)
        for (int64_t g = 0; g < G; ++g)
          sc[g * len + t] = scale * dot_widen(q + g * D, rows + t * ctx.token_stride, D);
    }
  }
  if (!values_early) prefetch_block(block(v, b_begin), block_bytes);  // while the softmax runs
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores.data() + h * len;
    float max_score = sc[0];  // no infinities: the kernel is built with -ffast-math
    for (int64_t t = 1; t < len; ++t) max_score = std::max(max_score, sc[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      // exp(x) < 1e-13 is below float32 rounding beside the max term (1): make it 0, and
      // keep exp's argument where the vector exp has no slow path
      const float xv = sc[t] - max_score;
      sc[t] = xv < kMinExponent ? 0.f : std::exp(std::max(xv, kMinExponent));
      sum += sc[t];
    }
    if (stats) {  // a partition: merged with the others' by their maxima
      stats[2 * h] = max_score;
      stats[2 * h + 1] = sum;
      continue;
    }
    const float inv_sum = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sc[t] *= inv_sum;
  }
  std::fill(out, out + heads * D, 0.f);
  for (int64_t b = b_begin; b < b_end; ++b) {
    if (b + 1 < b_end && !fast) prefetch_block(block(v, b + 1), block_bytes);
    const T* upcoming = nullptr;  // the next item's key rows in its block b - b_begin
    if (fast && b - b_begin < next_item.num_blocks) {
      const int32_t id = next_item.blocks[b - b_begin];
      if (id >= 0 && id < ctx.num_blocks)
        upcoming = k + id * ctx.block_stride + next_item.kv_begin * D;
    }
    const int64_t t0 = (b - b_begin) * bs, n = std::min(bs, len - t0);
    for (int64_t kv = kv_begin; kv < kv_end; ++kv) {
      const T* rows = block(v, b) + kv * D;
      const float* probs = scores.data() + (kv - kv_begin) * G * len + t0;
      float* o = out + (kv - kv_begin) * G * D;
#if defined(__AVX512F__) || defined(__AVX2__)
      if (fast) {
        with_group(G, [&](auto g) {
          values_d64<decltype(g)::value>(probs, rows, n, ctx.token_stride, o, len,
                                         values_early ? nullptr : ahead(v, b, kv),
                                         upcoming ? upcoming + (kv - kv_begin) * D : nullptr);
        });
        continue;
      }
#endif
      for (int64_t t = 0; t < n; ++t)
        for (int64_t g = 0; g < G; ++g)
          axpy_widen(probs[g * len + t], rows + t * ctx.token_stride, o + g * D, D);
    }
  }
}

// Writes values [n] (float32) to out at `offset`, in out's dtype (bfloat16 rounded as
// torch rounds).
void store_values(torch::Tensor& out, int64_t offset, const float* values, int64_t n) {
  if (out.scalar_type() == at::kBFloat16) {
    at::BFloat16* dst = out.data_ptr<at::BFloat16>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(values[i]);
  } else {
    std::copy(values, values + n, out.data_ptr<float>() + offset);
  }
}

// Contexts longer than this many tokens are attended in partitions of it, side by side, and
// merged: a lone long sequence spreads over the threads (its KV heads alone are too few, and
// uneven over 2 threads). The partitions follow from the sequence's length alone, so its rows
// are the same bits whatever the batch around it (sync and async give the same tokens).
constexpr int64_t kPartitionTokens = 512;

// out [heads, D] of `parts` partitions (acc [parts, heads, D] and stats [parts, heads, 2] as
// `attend` leaves them): sum_p w_p acc_p / sum_p w_p sum_p, w_p = exp(max_p - the maximum).
void merge_partitions(const float* acc, const float* stats, int64_t parts, int64_t heads,
                      int64_t D, float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    float top = stats[2 * h];
    for (int64_t p = 1; p < parts; ++p) top = std::max(top, stats[(p * heads + h) * 2]);
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    float total = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const float* st = stats + (p * heads + h) * 2;
      const float w = std::exp(st[0] - top);
      total += w * st[1];
      const float* a = acc + (p * heads + h) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
  }
}

template <typename T>
void decode_attention_impl(const torch::Tensor& q, const T* k_ptr, const T* v_ptr,
                           const PagedContext& ctx, int64_t num_kv_heads, float scale,
                           torch::Tensor& out) {
  const bool bf16_q = q.scalar_type() == at::kBFloat16;
  const int64_t num_seqs = q.size(0), row_size = q.size(1) * q.size(2);
  const int64_t bs = ctx.block_size, part_blocks = std::max<int64_t>(1, kPartitionTokens / bs);
  // the partitions of every sequence, in order: part_seq[p] is partition p's sequence, and
  // sequence s has partitions [first_part[s], first_part[s + 1])
  std::vector<int64_t> first_part(num_seqs + 1, 0), part_seq;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t used = (std::max<int64_t>(ctx.lens[seq], 0) + bs - 1) / bs;
    // before the partitions' buffers are sized by it
    TORCH_CHECK(used <= ctx.max_blocks, "decode_attention: seq_len beyond the block table");
    const int64_t parts = std::max<int64_t>(1, (used + part_blocks - 1) / part_blocks);
    first_part[seq + 1] = first_part[seq] + parts;
    part_seq.insert(part_seq.end(), parts, seq);
  }
  const int64_t num_parts = first_part[num_seqs];
  // an item is a partition's KV heads: all of them, or one when there are fewer partitions
  // than threads; the results are the same bits either way
  const int64_t heads_per_item = num_parts < at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t items_per_part = num_kv_heads / heads_per_item;
  const int64_t slice = heads_per_item * ctx.group * ctx.head_dim;  // an item's [heads, D]
  const int64_t num_heads = num_kv_heads * ctx.group, D = ctx.head_dim;
  // the partitions' unnormalized values [num_parts, num_heads, D] and [max, sum] per head,
  // where a sequence has more than one
  const bool split = num_parts > num_seqs;
  std::vector<float> part_acc(split ? num_parts * num_heads * D : 0);
  std::vector<float> part_stats(split ? num_parts * num_heads * 2 : 0);

  auto next_of = [&](int64_t item) {  // NextItem of `item`
    const int64_t part = item / items_per_part, seq = part_seq[part];
    const int64_t used = (std::max<int64_t>(ctx.lens[seq], 0) + bs - 1) / bs;
    const int64_t b_begin = (part - first_part[seq]) * part_blocks;
    return NextItem{ctx.tables + seq * ctx.max_blocks + b_begin,
                    std::max<int64_t>(0, std::min(used, b_begin + part_blocks) - b_begin),
                    item % items_per_part * heads_per_item};
  };
  at::parallel_for(0, num_parts * items_per_part, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(slice), query_rows(slice);
    for (int64_t item = begin; item < end; ++item) {
      const NextItem next_item = item + 1 < end ? next_of(item + 1) : NextItem{};
      const int64_t part = item / items_per_part, seq = part_seq[part];
      const int64_t kv_begin = item % items_per_part * heads_per_item;
      const int64_t head0 = kv_begin * ctx.group;  // the item's first query head
      const int64_t first = seq * row_size + head0 * D;
      if (ctx.lens[seq] <= 0) {  // nothing to attend to (never planned, but no garbage)
        std::fill(acc.begin(), acc.end(), 0.f);
        store_values(out, first, acc.data(), slice);
        continue;
      }
      const float* query;
      if (bf16_q) {
        const at::BFloat16* src = q.data_ptr<at::BFloat16>() + first;
        for (int64_t i = 0; i < slice; ++i) query_rows[i] = static_cast<float>(src[i]);
        query = query_rows.data();
      } else {
        query = q.data_ptr<float>() + first;
      }
      const int64_t parts = first_part[seq + 1] - first_part[seq];
      const int64_t used = (ctx.lens[seq] + bs - 1) / bs;
      if (parts == 1) {
        attend(ctx, seq, kv_begin, kv_begin + heads_per_item, 0, used, query, k_ptr, v_ptr,
               scale, scores, acc.data(), nullptr, next_item);
        store_values(out, first, acc.data(), slice);
        continue;
      }
      const int64_t b_begin = (part - first_part[seq]) * part_blocks;
      const int64_t b_end = std::min(used, b_begin + part_blocks);
      attend(ctx, seq, kv_begin, kv_begin + heads_per_item, b_begin, b_end, query, k_ptr, v_ptr,
             scale, scores, part_acc.data() + (part * num_heads + head0) * D,
             part_stats.data() + (part * num_heads + head0) * 2, next_item);
    }
  });
  if (!split) return;
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(num_heads * D);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t p0 = first_part[seq], parts = first_part[seq + 1] - p0;
      if (parts == 1 || ctx.lens[seq] <= 0) continue;  // written above
      merge_partitions(part_acc.data() + p0 * num_heads * D,
                       part_stats.data() + p0 * num_heads * 2, parts, num_heads, D,
                       merged.data());
      store_values(out, seq * row_size, merged.data(), num_heads * D);
    }
  });
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                               const torch::Tensor& seq_lens, double scale) {
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  (cache_dtype == at::kFloat || cache_dtype == at::kBFloat16) &&
                  v_cache.scalar_type() == cache_dtype,
              "decode_attention: float32 or bfloat16 q and caches (both caches alike) only");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "decode_attention: int32 block_tables and seq_lens");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "decode_attention: contiguous tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [B, Hq, D] and caches [blocks, block_size, Hkv, D]");
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim &&
                  block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "decode_attention: q and cache shapes disagree");

  // q and the output in q's dtype: a bfloat16 q is widened here (exact) and the output
  // rounded as torch's .to(bfloat16) rounds, so the two casts around the call are gone.
  auto out = torch::empty_like(q);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const PagedContext ctx{num_blocks,
                         block_size,
                         head_dim,
                         num_heads / num_kv_heads,
                         token_stride,
                         block_size * token_stride,
                         block_tables.size(1),
                         block_tables.data_ptr<int32_t>(),
                         seq_lens.data_ptr<int32_t>()};
  const float softmax_scale = static_cast<float>(scale);
  if (cache_dtype == at::kFloat)
    decode_attention_impl(q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), ctx,
                          num_kv_heads, softmax_scale, out);
  else
    decode_attention_impl(q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                          reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), ctx,
                          num_kv_heads, softmax_scale, out);
  return out;
}

// ------------------------------------------------------------------ a decode step's layers
// A decode-only step of 1 to kMaxRows rows through a stage's layers in one call: the fused
// layer of model/llama.py (`direct_layer`) as a C++ loop over the same kernels in the same
// order, so the same bits. What it spares is the return to Python between a layer's ~10
// kernels: their argument parsing, and the GIL, which the compute thread had to take back
// from the worker's event loop after each kernel (docs/performance.md, "A decode step's
// layers in one call"). model/llama.py `decode_stack` builds one where every matmul of a
// stage runs on small_linear, on one tensor-parallel rank.

using StackLinearArgs =
    std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
               c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>;

struct StackLinear {  // small_linear(x, weight, scale, bias, packed) [+ bias_after]
  torch::Tensor weight;
  c10::optional<torch::Tensor> scale, bias, packed, bias_after;

  torch::Tensor operator()(const torch::Tensor& x) const {
    auto out = small_linear(x, weight, scale, bias, packed);
    return bias_after.has_value() && bias_after->defined() ? out + *bias_after : out;
  }
};

struct StackLayer {
  torch::Tensor norm1, norm2;
  double eps1, eps2;
  StackLinear qkv, o, gate_up, down;
};

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), scale_(scale) {}

  // linears: (weight, scale, bias, packed, bias_after) of qkv, o, gate_up and down
  void add_layer(const torch::Tensor& norm1, double eps1, const torch::Tensor& norm2,
                 double eps2, const std::vector<StackLinearArgs>& linears) {
    TORCH_CHECK(linears.size() == 4, "DecodeStack.add_layer: qkv, o, gate_up and down");
    auto linear = [](const StackLinearArgs& a) {
      return StackLinear{std::get<0>(a), std::get<1>(a), std::get<2>(a), std::get<3>(a),
                         std::get<4>(a)};
    };
    layers_.push_back(StackLayer{norm1, norm2, eps1, eps2, linear(linears[0]),
                                 linear(linears[1]), linear(linears[2]), linear(linears[3])});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden] -> [T, hidden] after every layer; T <= kMaxRows rows, each decoding one
  // token (its K/V written at slot_mapping, attending over its sequence's blocks).
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos_table,
                        const torch::Tensor& sin_table, const torch::Tensor& positions,
                        const torch::Tensor& slot_mapping, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, const torch::Tensor& block_tables,
                        const torch::Tensor& seq_lens) const {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                "DecodeStack.forward: one K and one V cache per layer");
    TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows,
                "DecodeStack.forward: 1 to ", kMaxRows, " rows");
    const torch::Tensor tables = block_tables.to(at::kInt).contiguous();
    const torch::Tensor lens = seq_lens.to(at::kInt).contiguous();
    const int64_t rows = x.size(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& layer = layers_[i];
      const torch::Tensor qkv = layer.qkv(rms_norm(x.contiguous(), layer.norm1, layer.eps1));
      const torch::Tensor q =
          rope_write_kv(qkv.contiguous(), cos_table, sin_table, positions, k_caches[i],
                        v_caches[i], slot_mapping, num_heads_, num_kv_heads_);
      const torch::Tensor out =
          decode_attention(q.contiguous(), k_caches[i], v_caches[i], tables, lens, scale_)
              .reshape({rows, -1});
      auto [sum, normed] =
          add_rms_norm(x.contiguous(), layer.o(out).contiguous(), layer.norm2, layer.eps2);
      x = sum + layer.down(silu_mul(layer.gate_up(normed).contiguous()));
    }
    return x;
  }

 private:
  int64_t num_heads_, num_kv_heads_;
  double scale_;
  std::vector<StackLayer> layers_;
};

// How many of torch's intra-op threads an at::parallel_for of n items ran on: the kernels'
// parallel loops run in parallel only when this file is compiled with OpenMP (-fopenmp;
// without it at::parallel_for is a plain loop, and it silently was until 2026-12-01).
int64_t parallel_threads(int64_t n) {
  std::vector<std::atomic<bool>> ran(at::get_num_threads());
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { ran[at::get_thread_num()] = true; });
  return std::count(ran.begin(), ran.end(), true);
}

// The step's kernels run without the GIL, as torch's own ops do: the worker's event loop
// (plans in, reports out) runs beside them instead of making the compute thread wait at its
// next Python line for the GIL (docs/performance.md, "The kernels without the GIL").
// They touch no Python object; arguments and results are converted with the GIL held.
const auto kNoGil = py::call_guard<py::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, double>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("scale"))
      .def("add_layer", &DecodeStack::add_layer, "a layer's norms and its four matmuls")
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward,
           "a decode-only step of 1-4 rows through every layer (model/llama.py decode_stack)",
           kNoGil);
  m.def("parallel_threads", &parallel_threads,
        "how many intra-op threads a parallel loop of n items ran on");
  m.def("decode_attention", &decode_attention,
        "Paged decode attention over float32 or bfloat16 KV caches (CPU), q and output float32 "
        "or bfloat16",
        kNoGil);
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, hidden] rows (HF's order of operations)", kNoGil);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, RMSNorm(x + delta))", kNoGil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] -> [T, I]", kNoGil);
  m.def("rope_write_kv", &rope_write_kv,
        "RoPE of q and k from a fused qkv [T, (Hq+2Hkv)*D]; k, v written to the paged cache "
        "at slot_mapping; returns q [T, Hq, D]",
        kNoGil);
  m.def("small_linear", &small_linear, "x @ W.T * scale + bias for 1-4 rows (CPU)",
        py::arg("x"), py::arg("weight"), py::arg("scale") = py::none(),
        py::arg("bias") = py::none(), py::arg("packed") = py::none(), kNoGil);
  m.def("argmax_rows", &argmax_rows,
        "each row's first maximum of float32 or bfloat16 logits [N, V] (a NaN the largest)",
        kNoGil);
  m.def("bf16_pack_amx", &bf16_pack_amx,
        "the AMX-BF16 copy of bfloat16 weights [N, K] for small_linear's packed (batches of "
        "5 to 512 rows); None where the CPU has no AMX-BF16");
  m.def("int8_pack_amx", &int8_pack_amx,
        "the AMX (VNNI-4) copy of int8 weights [N, K] for small_linear's packed; None "
        "without AMX-INT8");
  m.attr("max_rows") = kMaxRows;
  m.def("int8_isas", &int8_isa_names, "instruction sets of the int8 dot on this CPU, best first");
  m.def("use_int8_isa", &use_int8_isa, "run the int8 dot with this one (tests compare them)");
  m.def("use_bf16_dot", &use_bf16_dot,
        "bfloat16 x and weights on the AVX512-BF16 dot where the CPU has it (True) or widened "
        "(False); returns whether the dot is on");
}
