// Fused CPU kernels for the torch engine's decode step (relax_core/engines/native_decode.py builds them), on
// fp32 or bf16 tensors: bf16 inputs, weights and cache rows are widened to fp32 as they are read, every sum is
// taken in fp32, and results are rounded to bf16 where torch's bf16 ops round them.
//
// Eager PyTorch spends most of a small model's decode step outside its matmuls: attention over the slot
// cache runs as two batched matmuls of tiny matrices plus mask, softmax and two scattered cache writes, and
// each norm or activation is several passes over memory. These kernels do each of those in one pass:
//   decode_attention: per (slot, KV head): q/k RMS norm and rotary, the new K/V written into the cache, and
//                     softmax attention of the head's G query heads over positions 0..len, reading every
//                     cached key and value row from memory once, and the prompt's rows from one slot for all
//                     of a prompt's samples (AVX2 builds: scores 8 keys at a time, the softmax on vectors,
//                     the weighted values accumulated in registers);
//   rms_norm:         x * rsqrt(mean(x^2) + eps) * w per row;
//   silu_mul:         silu(gate) * up for a fused [gate | up] projection;
//   sample_rows:      a token per row from softmax(logits) and its log-prob, in one pass over the logits.
#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <sleef.h>
#endif

namespace {

using bf16 = at::BFloat16;

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return static_cast<float>(x); }
// x in T's precision (bf16: rounded to nearest even, as torch rounds), as a float again
template <typename T>
inline float round_to(float x) {
  return widen(static_cast<T>(x));
}

// exp(x) for x <= 0, branch-free so the loops calling it vectorize: 2^k * p(f) with k = floor(x log2 e),
// f in [0, 1) and a degree-6 polynomial for 2^f (relative error below 2e-7).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float y = x * 1.44269504088896341f;
  const float k = std::floor(y);
  const float f = y - k;
  float p = 1.535336188e-4f;
  p = p * f + 1.339887440e-3f;
  p = p * f + 9.618437357e-3f;
  p = p * f + 5.550332471e-2f;
  p = p * f + 2.402264791e-1f;
  p = p * f + 6.931472028e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// RMS-normalise one head (weight w), then rotate it: out = n cos + rotate_half(n) sin_signed.
template <int64_t D, typename T>
inline void norm_rotate(const T* x, const float* w, const float* cos, const float* sin_signed, float eps,
                        float* out) {
  float sum_sq = 0.f;
  for (int64_t d = 0; d < D; ++d) sum_sq += widen(x[d]) * widen(x[d]);
  const float inv = 1.f / std::sqrt(sum_sq / D + eps);
  float n[D];
  for (int64_t d = 0; d < D; ++d) n[d] = widen(x[d]) * inv * w[d];
  constexpr int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = n[d] * cos[d] + n[d + half] * sin_signed[d];
  for (int64_t d = half; d < D; ++d) out[d] = n[d] * cos[d] + n[d - half] * sin_signed[d];
}

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

// A head's cached rows (keys or values) 0..n: rows before n_shared are read from another slot holding the same
// prompt (the first live sample of it), the rest from the slot's own cache. The n samples of a prompt then
// read one copy of its prompt rows, which stays in cache from one sample to the next.
template <int64_t D, typename T>
struct CacheRows {
  const T* shared;
  const T* own;
  int64_t n_shared;
  const T* at(int64_t t) const { return (t < n_shared ? shared : own) + t * D; }
};

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes at a time: the scores of 8 keys come out of one transposed reduction, softmax runs on vectors.
constexpr int64_t kLanes = 8;

// [sum(a[0]), ..., sum(a[7])]: the horizontal sums of 8 vectors in 9 shuffles/adds.
inline __m256 transpose_sum(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// exp_nonpositive on 8 lanes (the same polynomial).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 k = _mm256_floor_ps(y);
  const __m256 f = _mm256_sub_ps(y, k);
  __m256 p = _mm256_set1_ps(1.535336188e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
// 8 bf16 widened to fp32: a bf16 is the high half of the float with the same bits
inline __m256 load8(const bf16* x) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline float max_of(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float sum_of(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// scores[t] = q . key_t for t < n (scores padded to a multiple of 8; padding lanes are -inf).
template <int64_t D, typename T>
inline void key_scores(const float* q, const CacheRows<D, T>& K, int64_t n, float* scores) {
  constexpr int64_t V = D / kLanes;
  __m256 qv[V];
  for (int64_t v = 0; v < V; ++v) qv[v] = _mm256_load_ps(q + v * kLanes);
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    __m256 acc[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      acc[j] = _mm256_setzero_ps();
      if (t0 + j < n) {
        const T* key = K.at(t0 + j);
        for (int64_t v = 0; v < V; ++v) acc[j] = _mm256_fmadd_ps(qv[v], load8(key + v * kLanes), acc[j]);
      }
    }
    _mm256_storeu_ps(scores + t0, transpose_sum(acc));
  }
  for (int64_t t = n; t % kLanes; ++t) scores[t] = -INFINITY;
}

// softmax of scores[0..n) in place (padded to 8 lanes with -inf; the padding becomes exactly 0).
inline void softmax(float* s, int64_t n) {
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  __m256 top = minus_inf;
  for (int64_t t = 0; t < padded; t += kLanes) top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));
  const __m256 m = _mm256_set1_ps(max_of(top));
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += kLanes) {
    const __m256 x = _mm256_loadu_ps(s + t);
    // exp_nonpositive8 clamps at -87, so padding would give 1e-38, not 0: mask it out
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, minus_inf, _CMP_NEQ_OQ));
    total = _mm256_add_ps(total, e);
    _mm256_storeu_ps(s + t, e);
  }
  const __m256 inv = _mm256_set1_ps(1.f / sum_of(total));
  for (int64_t t = 0; t < padded; t += kLanes) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
}

// out[0..D) = sum_t p[t] value_t, accumulating 64 columns at a time in registers.
template <int64_t D, typename T>
inline void weighted_values(const float* p, const CacheRows<D, T>& V, int64_t n, float* out) {
  constexpr int64_t kCols = D < 64 ? D : 64, kVecs = kCols / kLanes;
  for (int64_t c = 0; c < D; c += kCols) {
    __m256 acc[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const __m256 w = _mm256_broadcast_ss(p + t);
      const T* value = V.at(t) + c;
      for (int64_t v = 0; v < kVecs; ++v) acc[v] = _mm256_fmadd_ps(w, load8(value + v * kLanes), acc[v]);
    }
    for (int64_t v = 0; v < kVecs; ++v) _mm256_storeu_ps(out + c + v * kLanes, acc[v]);
  }
}
#endif

// One slot's KV head h: write the new key/value at position len, attend its G query heads over 0..len (rows
// before n_shared from K_shared / V_shared). scores holds G rows of T + 8 floats.
template <int64_t D, typename S>
void attend_head(const S* qkv, S* K, S* V, const S* K_shared, const S* V_shared, int64_t n_shared, int64_t len,
                 int64_t H, int64_t Hkv, int64_t h, int64_t T, const float* cos, const float* sin_signed,
                 const float* norm_w, float eps, float* scores, S* out) {
  const int64_t G = H / Hkv, n = len + 1, stride = T + 8;
  alignas(64) float k_new[D];
  norm_rotate<D>(qkv + (H + h) * D, norm_w + (H + h) * D, cos, sin_signed, eps, k_new);
  for (int64_t d = 0; d < D; ++d) K[len * D + d] = static_cast<S>(k_new[d]);
  std::memcpy(V + len * D, qkv + (H + Hkv + h) * D, D * sizeof(S));
  const CacheRows<D, S> keys{K_shared, K, n_shared}, values{V_shared, V, n_shared};
  alignas(64) float q[kMaxGroup][D];
  for (int64_t g = 0; g < G; ++g) {
    norm_rotate<D>(qkv + (h * G + g) * D, norm_w + (h * G + g) * D, cos, sin_signed, eps, q[g]);
  }
#if defined(__AVX2__) && defined(__FMA__)
  alignas(64) float head_out[D];
  for (int64_t g = 0; g < G; ++g) {  // the head's keys and values stay in L1 across its G query heads
    key_scores<D>(q[g], keys, n, scores + g * stride);
    softmax(scores + g * stride, n);
    weighted_values<D>(scores + g * stride, values, n, head_out);
    for (int64_t d = 0; d < D; ++d) out[(h * G + g) * D + d] = static_cast<S>(head_out[d]);
  }
#else
  for (int64_t t = 0; t < n; ++t) {  // every key row read once for the G query heads
    const S* key = keys.at(t);
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += q[g][d] * widen(key[d]);
      scores[g * stride + t] = dot;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    float top = s[0];
    for (int64_t t = 1; t < n; ++t) top = std::max(top, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_nonpositive(s[t] - top);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
  alignas(64) float acc[kMaxGroup][D] = {};
  for (int64_t t = 0; t < n; ++t) {  // every value row read once
    const S* value = values.at(t);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * stride + t];
      for (int64_t d = 0; d < D; ++d) acc[g][d] += p * widen(value[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) out[(h * G + g) * D + d] = static_cast<S>(acc[g][d]);
  }
#endif
}

// Ask for every cache line of x[0..n) up front, into every cache level: the head's keys and values arrive in
// parallel rather than one miss at a time. Measured on an Intel Xeon (Emerald Rapids) host, a tiny-model batch
// took 0.42 s with this hint, 0.45 s with no prefetch and 0.54 s with the non-temporal hint (which there made
// both the attention and the projection matmuls slower).
template <typename S>
inline void prefetch_rows(const S* x, int64_t n) {
#if defined(__SSE__)
  for (int64_t i = 0; i < n; i += 64 / sizeof(S)) _mm_prefetch(reinterpret_cast<const char*>(x + i), _MM_HINT_T0);
#endif
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// float32 or bfloat16, the same as `like`'s
void check_dtype_of(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == like.scalar_type() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " is ", t.scalar_type(), ": the kernels run float32 or bfloat16 tensors of one dtype");
}

template <typename S>
void attend_all(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* len_p,
                const int64_t* share_slot_p, const int64_t* share_len_p, const float* cos_p, const float* sin_p,
                const float* w_p, float eps, int64_t H, at::Tensor& out) {
  const int64_t R = qkv.size(0), Hkv = k_cache.size(1), T = k_cache.size(2), D = k_cache.size(3);
  auto attend = D == 32    ? attend_head<32, S>
                : D == 64  ? attend_head<64, S>
                : D == 128 ? attend_head<128, S>
                           : nullptr;
  TORCH_CHECK(attend != nullptr, "head_dim ", D, " has no fused decode kernel (32, 64, 128)");
  const S* qkv_p = qkv.data_ptr<S>();
  S* k_p = k_cache.data_ptr<S>();
  S* v_p = v_cache.data_ptr<S>();
  S* out_p = out.data_ptr<S>();
  const int64_t G = H / Hkv, row = qkv.size(1);
  at::parallel_for(0, R * Hkv, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * (T + 8));
    for (int64_t i = begin; i < end; ++i) {  // i = slot * Hkv + KV head
      const int64_t r = i / Hkv, len = len_p[r], n_shared = share_len_p[r];
      const int64_t own = i * T * D, shared = (share_slot_p[r] * Hkv + i % Hkv) * T * D;
      prefetch_rows(k_p + shared, n_shared * D);
      prefetch_rows(v_p + shared, n_shared * D);
      prefetch_rows(k_p + own + n_shared * D, (len + 1 - n_shared) * D);
      prefetch_rows(v_p + own + n_shared * D, (len + 1 - n_shared) * D);
      attend(qkv_p + r * row, k_p + own, v_p + own, k_p + shared, v_p + shared, n_shared, len, H, Hkv, i % Hkv,
             T, cos_p + len * D, sin_p + len * D, w_p, eps, scores.data(), out_p + r * H * D);
    }
  });
}

// out = w * x / rms(x) per row; in bf16 rounded where torch's bf16 RMSNorm rounds (x / rms(x), then the product)
template <typename S>
void rms_norm_rows(const S* x_p, const S* w_p, float eps, int64_t R, int64_t C, S* out_p) {
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* xr = x_p + r * C;
      float sum_sq = 0.f;
      for (int64_t c = 0; c < C; ++c) sum_sq += widen(xr[c]) * widen(xr[c]);
      const float inv = 1.f / std::sqrt(sum_sq / C + eps);
      S* o = out_p + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = static_cast<S>(round_to<S>(widen(xr[c]) * inv) * widen(w_p[c]));
    }
  });
}

// out = silu(gate) * up; in bf16 rounded where torch's bf16 ops round (silu, then the product)
template <typename S>
void silu_mul_rows(const S* in_p, int64_t R, int64_t I, S* out_p) {
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* gate = in_p + r * 2 * I;
      const S* up = gate + I;
      S* o = out_p + r * I;
      for (int64_t c = 0; c < I; ++c) {
        const float g = widen(gate[c]);
        const float e = exp_nonpositive(-std::abs(g));  // sigmoid from exp(-|g|): no overflow
        const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        o[c] = static_cast<S>(round_to<S>(g * sigmoid) * widen(up[c]));
      }
    }
  });
}

}  // namespace

// qkv [R, (H + 2 Hkv) D] (one row per live slot, slots 0..R-1); k_cache, v_cache [S, Hkv, T, D] (one layer);
// lens [R] int64: each slot's position of the new token; cos, sin_signed [T, D]: rotary tables per position;
// norm_w [H + Hkv, D]: q norm weights (attention scaling folded in), then k norm weights; share_slots,
// share_lens [R] int64: slot r reads its cache rows before share_lens[r] from slot share_slots[r] (which holds
// the same rows: the same prompt), the rest from its own. qkv and the caches are float32 or bfloat16 (one dtype),
// the tables and norm weights float32. Returns [R, H D] in qkv's dtype.
at::Tensor decode_attention(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache,
                               const at::Tensor& lens, const at::Tensor& share_slots,
                               const at::Tensor& share_lens, const at::Tensor& cos,
                               const at::Tensor& sin_signed, const at::Tensor& norm_w, double eps,
                               int64_t n_heads) {
  check_dtype_of(qkv, "qkv", qkv);
  check_dtype_of(k_cache, "k_cache", qkv);
  check_dtype_of(v_cache, "v_cache", qkv);
  check_f32(cos, "cos");
  check_f32(sin_signed, "sin_signed");
  check_f32(norm_w, "norm_w");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous(), "lens must be contiguous int64");
  const int64_t R = qkv.size(0), Hkv = k_cache.size(1), T = k_cache.size(2);
  const int64_t H = n_heads;
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= kMaxGroup, "unsupported heads per KV head: ", H, "/", Hkv);
  TORCH_CHECK(R <= k_cache.size(0) && lens.size(0) == R, "more rows than cache slots or lens");
  for (const auto* t : {&share_slots, &share_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == R,
                "share_slots and share_lens must be contiguous int64 with one entry per row");
  }
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const int64_t* share_slot_p = share_slots.data_ptr<int64_t>();
  const int64_t* share_len_p = share_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(len_p[r] >= 0 && len_p[r] < T, "slot ", r, ": position ", len_p[r], " is outside the cache");
    // shared rows lie before both slots' new positions, so no slot writes a row another one reads
    TORCH_CHECK(share_slot_p[r] >= 0 && share_slot_p[r] < R && share_len_p[r] >= 0 && share_len_p[r] <= len_p[r] &&
                    share_len_p[r] <= len_p[share_slot_p[r]],
                "slot ", r, ": shares ", share_len_p[r], " rows of slot ", share_slot_p[r], " (live rows: ", R,
                ", position ", len_p[r], ")");
  }
  auto out = at::empty({R, H * k_cache.size(3)}, qkv.options());
  const auto run = qkv.scalar_type() == at::kBFloat16 ? attend_all<bf16> : attend_all<float>;
  run(qkv, k_cache, v_cache, len_p, share_slot_p, share_len_p, cos.data_ptr<float>(), sin_signed.data_ptr<float>(),
      norm_w.data_ptr<float>(), static_cast<float>(eps), H, out);
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_dtype_of(x, "x", x);
  check_dtype_of(w, "w", x);
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<bf16>(), w.data_ptr<bf16>(), eps, x.size(0), x.size(1), out.data_ptr<bf16>());
  } else {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), eps, x.size(0), x.size(1), out.data_ptr<float>());
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_dtype_of(gate_up, "gate_up", gate_up);
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({R, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows(gate_up.data_ptr<bf16>(), R, I, out.data_ptr<bf16>());
  } else {
    silu_mul_rows(gate_up.data_ptr<float>(), R, I, out.data_ptr<float>());
  }
  return out;
}

inline float row_max(const float* z, int64_t n) {
  float top = z[0];
  int64_t v = 1;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= kLanes) {
    __m256 lanes = _mm256_loadu_ps(z);
    for (v = kLanes; v + kLanes <= n; v += kLanes) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(z + v));
    top = max_of(lanes);
  }
#endif
  for (; v < n; ++v) top = std::max(top, z[v]);
  return top;
}

// out[v] = exp(z[v] - top) for v < n, with the exp torch's own vectorised kernels use (SLEEF, linked into
// libtorch_cpu) where this build has AVX2, so the weights are the ones torch computes bit for bit.
inline void exp_shifted(const float* z, float top, int64_t n, float* out) {
  int64_t v = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 shift = _mm256_set1_ps(top);
  for (; v + kLanes <= n; v += kLanes) {
    _mm256_storeu_ps(out + v, Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(z + v), shift)));
  }
  if (v < n) {  // the row's last lanes, padded with -inf (exp 0)
    alignas(32) float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = v + j < n ? z[v + j] : -INFINITY;
    _mm256_store_ps(tail, Sleef_expf8_u10(_mm256_sub_ps(_mm256_load_ps(tail), shift)));
    std::memcpy(out + v, tail, (n - v) * sizeof(float));
  }
#else
  for (; v < n; ++v) out[v] = std::exp(z[v] - top);
#endif
}

// Inverse-CDF sampling, one uniform per row (torch_engine.sample_tokens does the same with torch ops): the
// weights w = exp(z - max z), their running sum accumulated in double and stored as float (as torch.cumsum
// does), the token is the first whose running sum exceeds u * total (u < 1 keeps that below total in float).
// Also its log-prob z - max z - log(sum w). Returns (token [R] int64, log-prob [R] float).
std::vector<at::Tensor> sample_rows(const at::Tensor& scaled, const at::Tensor& uniforms) {
  check_f32(scaled, "scaled");
  check_f32(uniforms, "uniforms");
  const int64_t R = scaled.size(0), V = scaled.size(1);
  TORCH_CHECK(uniforms.numel() == R, "sample_rows: ", uniforms.numel(), " uniforms for ", R, " rows");
  auto token = at::empty({R}, scaled.options().dtype(at::kLong));
  auto logprob = at::empty({R}, scaled.options());
  const float* z_p = scaled.data_ptr<float>();
  const float* u_p = uniforms.data_ptr<float>();
  int64_t* token_p = token.data_ptr<int64_t>();
  float* logprob_p = logprob.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> cdf(V);
    for (int64_t r = begin; r < end; ++r) {
      const float* z = z_p + r * V;
      const float top = row_max(z, V);
      exp_shifted(z, top, V, cdf.data());
      double running = 0.0;
      for (int64_t v = 0; v < V; ++v) {
        running += cdf[v];
        cdf[v] = static_cast<float>(running);
      }
      const float target = u_p[r] * cdf[V - 1];
      const int64_t pick = std::upper_bound(cdf.begin(), cdf.end() - 1, target) - cdf.begin();
      token_p[r] = pick;
      logprob_p[r] = static_cast<float>(static_cast<double>(z[pick] - top) - std::log(running));
    }
  });
  return {token, logprob};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "fused decode attention with cache write (fp32 or bf16)");
  m.def("rms_norm", &rms_norm, "row-wise RMS norm (fp32 or bf16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (fp32 or bf16)");
  m.def("sample_rows", &sample_rows, "inverse-CDF sampling of one token per row, and its log-prob (fp32)");
}
