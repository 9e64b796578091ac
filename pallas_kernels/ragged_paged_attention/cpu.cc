// Ragged paged attention for steps of few query rows (decodes), on a CPU: the reference's
// semantics (reference.py, ragged_paged_attention; float32, int8 or fp8 pages, a quantized pool's
// scales folded into q and the output by the caller), one pass over each sequence's
// keys per query row and KV head, with the query heads that share the KV head read together.
//
// XLA:CPU runs the reference's loop over key chunks as a nest of while loops, each iteration a
// handful of small programs: at one decode row a layer's attention costs ~0.15 ms of that
// overhead, more than its arithmetic. Here a (row, KV head) pair is one unit of work.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "native.h"

namespace jaxserve {
namespace {

// e^x for x <= 0 (scores less their maximum) in a form the compiler vectorizes, unlike expf:
// x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^7 (relative error < 2e-7,
// as expf's float result), 2^n put into the exponent bits; below -87, 0.
inline float ExpNonPositive(float x) {
  const float n = __builtin_roundf(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float scaled = p * __builtin_bit_cast(float, bits);
  return x < -87.0f ? 0.0f : scaled;
}

// fp8 bytes -> float, by table: e4m3fn (bias 7, no infinities, S.1111.111 NaN) and e5m2 (bias
// 15, IEEE-like). Subnormals included.
struct Fp8Table {
  float value[256];
  Fp8Table(int exp_bits, int bias, bool ieee) {
    const int man_bits = 7 - exp_bits, exp_max = (1 << exp_bits) - 1;
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> man_bits) & exp_max, m = b & ((1 << man_bits) - 1);
      const float frac = static_cast<float>(m) / static_cast<float>(1 << man_bits);
      float v;
      if (e == exp_max && (ieee || m == (1 << man_bits) - 1))
        v = ieee && m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
      else if (e == 0)
        v = std::ldexp(frac, 1 - bias);
      else
        v = std::ldexp(1.0f + frac, e - bias);
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const Fp8Table kE4M3FN(4, 7, false), kE5M2(5, 15, true);

// A key or value row of the pool as float32: float pages are read in place; int8 and fp8 pages
// (their stored values; the scales are applied outside the kernel) are cast into `buf`.
struct Pages {
  const void* data;
  ffi::DataType type;
  const float* Row(size_t offset, int d, float* buf) const {
    switch (type) {
      case ffi::DataType::S8: {
        const int8_t* r = static_cast<const int8_t*>(data) + offset;
#pragma omp simd
        for (int e = 0; e < d; ++e) buf[e] = static_cast<float>(r[e]);
        return buf;
      }
      case ffi::DataType::F8E4M3FN:
      case ffi::DataType::F8E5M2: {
        const uint8_t* r = static_cast<const uint8_t*>(data) + offset;
        const float* table = type == ffi::DataType::F8E4M3FN ? kE4M3FN.value : kE5M2.value;
        for (int e = 0; e < d; ++e) buf[e] = table[r[e]];
        return buf;
      }
      default:
        return static_cast<const float*>(data) + offset;
    }
  }
};

struct Shapes {
  int rows, q_heads, head_dim, num_pages, kv_heads, page_size, max_seqs, pages_per_seq;
};

// Calls fn(j, key or value row) for the positions lo + j < hi of a sequence, page by page (no
// division per key). `which`: 0 keys, 1 values.
template <typename F>
inline void ForEachRow(const Shapes& s, const Pages& pages, const int32_t* table, int h, int which, int lo,
                       int hi, const F& fn) {
  const size_t tile = static_cast<size_t>(s.page_size) * s.head_dim;  // one (page, head, k|v) tile
  float buf[512];  // a cast row (head_dim <= 512, checked by the handler)
  for (int pos = lo; pos < hi;) {
    const int index = pos / s.page_size, end = std::min(hi, (index + 1) * s.page_size);
    const int id = table[index];
    const size_t page = static_cast<size_t>(id < 0 || id >= s.num_pages ? 0 : id);  // padding: page 0
    size_t row = (page * 2 * s.kv_heads + 2 * h + which) * tile + static_cast<size_t>(pos % s.page_size) * s.head_dim;
    for (; pos < end; ++pos, row += s.head_dim) fn(pos - lo, pages.Row(row, s.head_dim, buf));
  }
}

// One query row (its `group` query heads sharing KV head h) against keys [lo, hi) of its sequence.
void AttendRow(const Shapes& s, const float* q, const Pages& pages, const int32_t* table, int h,
               int lo, int hi, float sm_scale, float soft_cap, float* out) {
  const int d = s.head_dim, group = s.q_heads / s.kv_heads, n = hi - lo;
  thread_local std::vector<float> scores;
  scores.resize(static_cast<size_t>(group) * (n > 0 ? n : 1));
  const float* qh = q + static_cast<size_t>(h) * group * d;
  ForEachRow(s, pages, table, h, 0, lo, hi, [&](int j, const float* key) {
    for (int g = 0; g < group; ++g) {
      const float* qg = qh + static_cast<size_t>(g) * d;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int e = 0; e < d; ++e) dot += qg[e] * key[e];
      dot *= sm_scale;
      if (soft_cap > 0) dot = soft_cap * std::tanh(dot / soft_cap);
      scores[static_cast<size_t>(g) * n + j] = dot;
    }
  });
  float* o = out + static_cast<size_t>(h) * group * d;
  std::fill(o, o + static_cast<size_t>(group) * d, 0.0f);
  if (n <= 0) return;
  for (int g = 0; g < group; ++g) {
    float* sg = scores.data() + static_cast<size_t>(g) * n;
    float m = -std::numeric_limits<float>::infinity(), total = 0;
    for (int j = 0; j < n; ++j) m = std::max(m, sg[j]);
#pragma omp simd reduction(+ : total)
    for (int j = 0; j < n; ++j) total += (sg[j] = ExpNonPositive(sg[j] - m));
    const float inv = 1.0f / total;
    for (int j = 0; j < n; ++j) sg[j] *= inv;
  }
  ForEachRow(s, pages, table, h, 1, lo, hi, [&](int j, const float* value) {
    for (int g = 0; g < group; ++g) {
      const float p = scores[static_cast<size_t>(g) * n + j];
      float* og = o + static_cast<size_t>(g) * d;
#pragma omp simd
      for (int e = 0; e < d; ++e) og[e] += p * value[e];
    }
  });
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kv_pages,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::Buffer<ffi::S32> window, float sm_scale, float soft_cap,
                                ffi::ResultBuffer<ffi::F32> out) {
  // q [rows, q_heads, d]; kv_pages [pages, 2 * kv_heads, page_size, d]; kv_lens [max_seqs];
  // page_indices [max_seqs, pages_per_seq]; cu_q_lens [max_seqs + 1]; num_seqs [1]; window []
  // (keys a query sees at most; <= 0: all) -> out [rows, q_heads, d]
  const auto qd = q.dimensions(), kd = kv_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: bad ranks");
  const Shapes s{static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(qd[2]),
                 static_cast<int>(kd[0]), static_cast<int>(kd[1] / 2), static_cast<int>(kd[2]),
                 static_cast<int>(pd[0]), static_cast<int>(pd[1])};
  if (kd[3] != s.head_dim || s.q_heads % s.kv_heads || s.head_dim > 512)
    return ffi::Error::InvalidArgument("ragged_paged_attention: head shapes disagree");
  const ffi::DataType type = kv_pages.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::S8 && type != ffi::DataType::F8E4M3FN &&
      type != ffi::DataType::F8E5M2)
    return ffi::Error::InvalidArgument("ragged_paged_attention: pages must be float32, int8 or fp8");
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int seqs = std::min(num_seqs.typed_data()[0], s.max_seqs);
  const int win = window.typed_data()[0];
  const float* qp = q.typed_data();
  const Pages pages{kv_pages.untyped_data(), type};
  const int32_t* tables = page_indices.typed_data();
  float* op = out->typed_data();
  const size_t row_size = static_cast<size_t>(s.q_heads) * s.head_dim;
  std::fill(op, op + row_size * s.rows, 0.0f);  // padding rows: zero
  // the live rows with their sequences; a unit of work is a (live row, KV head) pair
  std::vector<std::pair<int, int>> live;
  for (int i = 0; i < seqs; ++i)
    for (int r = std::max(cu[i], 0); r < std::min(cu[i + 1], s.rows); ++r) live.emplace_back(r, i);
  auto unit = [&](int u) {
    const auto [row, i] = live[u / s.kv_heads];
    const int h = u % s.kv_heads;
    const int pos = lens[i] - (cu[i + 1] - cu[i]) + (row - cu[i]);  // the row's position in its sequence
    const int hi = std::min(pos + 1, s.pages_per_seq * s.page_size);
    const int lo = win > 0 ? std::max(0, pos - win + 1) : 0;
    AttendRow(s, qp + row * row_size, pages, tables + static_cast<size_t>(i) * s.pages_per_seq, h, lo, hi,
              sm_scale, soft_cap, op + row * row_size);
  };
  const int units = static_cast<int>(live.size()) * s.kv_heads;
  long keys = 0;  // keys read over all live rows: a sequence's rows each read theirs
  for (const auto& [row, i] : live) keys += std::min(lens[i] - (cu[i + 1] - row) + 1, win > 0 ? win : lens[i]);
  if (keys * s.q_heads < 4096) {  // too little work to share out
    for (int u = 0; u < units; ++u) unit(u);
  } else {
    ParallelFor(pool, units, unit);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, jaxserve::RaggedPagedAttention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()   // q
                                  .Arg<xla::ffi::AnyBuffer>()               // kv_pages
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // kv_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // page_indices
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // cu_q_lens
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // num_seqs
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()   // window
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // out

// Rows of new keys and values into the pool, in place (the output aliases the pool): values row i
// goes to pool row rows[i], rows past the pool dropped; bytes are copied as they are, any dtype.
// XLA:CPU has no fp8 scatter: it converts the whole pool to float32 and back around one (or copies
// it twice around a scatter of its bytes), per layer and step; here only the written rows move.
namespace jaxserve {
namespace {

ffi::Error WriteRows(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values,
                     ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions();
  const auto vd = values.dimensions();
  if (pd.size() < 2 || vd.size() != 2 || pd.back() != vd[1] || pool.element_type() != values.element_type() ||
      rows.element_count() != static_cast<size_t>(vd[0]))
    return ffi::Error::InvalidArgument("write_rows: pool [..., d], values [n, d] of its dtype, n row indices");
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());  // not aliased
  const size_t width = values.size_bytes() / static_cast<size_t>(vd[0]);
  const int64_t count = static_cast<int64_t>(pool.size_bytes() / width);  // the pool's rows of d
  const auto* src = static_cast<const uint8_t*>(values.untyped_data());
  const int32_t* at = rows.typed_data();
  for (int64_t i = 0; i < vd[0]; ++i)
    if (at[i] >= 0 && at[i] < count) std::memcpy(dst + at[i] * width, src + i * width, width);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteRows, jaxserve::WriteRows,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()              // pool [..., d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // rows [n]
                                  .Arg<xla::ffi::AnyBuffer>()              // values [n, d]
                                  .Ret<xla::ffi::AnyBuffer>());            // the pool, written
