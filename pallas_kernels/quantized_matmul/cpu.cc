// x @ W for the rows of x and a 4-bit kernel W in tiles, reading W's bytes once (see native.py for why).
//
// W is one layer of a stack in layers/linear.py's tiled 4-bit layout: packed [layers, n / 64, k / 2, 64],
// each tile of 64 output columns contiguous (a tile streams from memory; the untiled layout's rows, n
// bytes apart, cost a TLB miss and a DRAM page per row and ran this kernel 3x slower). Within a tile,
// byte row 32b + i holds input 64b + i in its low nibble and input 64b + 32 + i in its high one, and
// w = q * scale + min with a scale and a min per group of 32 inputs ([layers, n / 64, k / 64, 2, 64]).
// Taking the whole stack and the layer index spares XLA a copy of the layer's slice before the call.
//
// The products are integer: each row of x is quantized per group of 32 inputs to int16 (scale
// max|x| / 32767, a relative error ~1e-5, far inside float32 matmul tolerances; llama.cpp goes to
// int8), and per group sum_i x_i (q_i s + m) = s dx (sum_i xq_i q_i) + m (sum_i x_i), the integer
// sum exact in int32 and the float sum of x taken before quantizing. With AVX-512 VNNI one
// instruction multiplies-adds 32 pairs (vpdpwssd), 2x-4x fewer instructions than unpacking the
// nibbles to float; elsewhere the same arithmetic in plain loops gives the same values.
// The reference: quantized_matmul/reference.py, q4_matmul_reference (same arguments).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native.h"

namespace jaxserve {
namespace {

constexpr int kGroup = 32;  // inputs per scale and min
constexpr int kTile = 64;   // output columns per tile: one cache line of each byte row
constexpr int kBand = 32;   // byte rows per pair of groups
constexpr float kInt16Max = 32767.0f;

// x's rows quantized per group: int16 values [rows, k], and per group the scale and the float sum.
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

// `padded` >= rows; the padding rows are zero.
QuantizedRows Quantize(const float* x, int rows, int padded, int k) {
  const int groups = k / kGroup;
  QuantizedRows out{std::vector<int16_t>(static_cast<size_t>(padded) * k),
                    std::vector<float>(static_cast<size_t>(padded) * groups),
                    std::vector<float>(static_cast<size_t>(padded) * groups)};
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      const float* v = x + static_cast<size_t>(r) * k + g * kGroup;
      float amax = 0, sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0 ? kInt16Max / amax : 0.0f;
      int16_t* q = out.q.data() + static_cast<size_t>(r) * k + g * kGroup;
      for (int i = 0; i < kGroup; ++i) q[i] = static_cast<int16_t>(std::nearbyint(v[i] * inv));
      out.scale[r * groups + g] = amax / kInt16Max;
      out.sum[r * groups + g] = sum;
    }
  return out;
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)

// R rows of y over one tile, in blocks of 16 Z columns whose R * Z int32 sums of both nibbles and
// float totals stay in registers (so Z shrinks as R grows). Writes the first `valid` rows of y,
// whose rows are n apart.
template <int R, int Z>
void Q4Tile(const int16_t* xq, const float* dx, const float* xsum, int k, const uint8_t* q,
            const float* scale, const float* mins, float* y, int n, int valid) {
  const int groups = k / kGroup;
  const __m512i nibble = _mm512_set1_epi32(0x000F000F);
  const __mmask64 even = 0x5555555555555555ULL;  // bytes 0 and 2 of each 32-bit lane
  for (int z0 = 0; z0 < kTile / 16; z0 += Z) {
    // lane j of block z: byte row a's column 16 (z0 + z) + j in byte 0, the next row's in byte 2
    __m512i spread[Z];
    for (int z = 0; z < Z; ++z) {
      alignas(64) uint8_t index[64] = {};
      for (int j = 0; j < 16; ++j) {
        index[4 * j] = static_cast<uint8_t>(16 * z + j);
        index[4 * j + 2] = static_cast<uint8_t>(64 + 16 * z + j);
      }
      spread[z] = _mm512_load_si512(index);
    }
    __m512 acc[R][Z];
    for (int r = 0; r < R; ++r)
      for (int z = 0; z < Z; ++z) acc[r][z] = _mm512_setzero_ps();
    for (int b = 0; b < k / 64; ++b) {
      __m512i lo[R][Z], hi[R][Z];
      for (int r = 0; r < R; ++r)
        for (int z = 0; z < Z; ++z) lo[r][z] = hi[r][z] = _mm512_setzero_si512();
      const uint8_t* qb = q + static_cast<size_t>(b) * kBand * kTile + 16 * z0;
      for (int i = 0; i < kBand; i += 2) {  // two byte rows: a pair of inputs per 32-bit lane
        const uint8_t* qa = qb + i * kTile;
        __m512i a, c;
        if constexpr (Z == 4) {
          a = _mm512_loadu_si512(qa);
          c = _mm512_loadu_si512(qa + kTile);
        } else if constexpr (Z == 2) {
          a = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa)));
          c = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + kTile)));
        } else {
          a = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa)));
          c = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + kTile)));
        }
        for (int z = 0; z < Z; ++z) {
          const __m512i pair = _mm512_maskz_permutex2var_epi8(even, a, spread[z], c);
          const __m512i wl = _mm512_and_si512(pair, nibble);
          const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(pair, 4), nibble);
          for (int r = 0; r < R; ++r) {
            const int16_t* xr = xq + static_cast<size_t>(r) * k + 64 * b + i;
            int32_t xl, xh;  // inputs 64b + i, + 1 (low nibbles) and 64b + 32 + i, + 1 (high)
            std::memcpy(&xl, xr, 4);
            std::memcpy(&xh, xr + 32, 4);
            lo[r][z] = _mm512_dpwssd_epi32(lo[r][z], wl, _mm512_set1_epi32(xl));
            hi[r][z] = _mm512_dpwssd_epi32(hi[r][z], wh, _mm512_set1_epi32(xh));
          }
        }
      }
      const float* s = scale + static_cast<size_t>(2 * b) * kTile + 16 * z0;  // [2, 64]: low first
      const float* m = mins + static_cast<size_t>(2 * b) * kTile + 16 * z0;
      for (int r = 0; r < R; ++r) {
        const float* d = dx + r * groups + 2 * b;
        const float* xs = xsum + r * groups + 2 * b;
        for (int z = 0; z < Z; ++z) {
          __m512 t = acc[r][z];
          const __m512 plo = _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r][z]), _mm512_set1_ps(d[0]));
          const __m512 phi = _mm512_mul_ps(_mm512_cvtepi32_ps(hi[r][z]), _mm512_set1_ps(d[1]));
          t = _mm512_fmadd_ps(plo, _mm512_loadu_ps(s + 16 * z), t);
          t = _mm512_fmadd_ps(_mm512_loadu_ps(m + 16 * z), _mm512_set1_ps(xs[0]), t);
          t = _mm512_fmadd_ps(phi, _mm512_loadu_ps(s + kTile + 16 * z), t);
          t = _mm512_fmadd_ps(_mm512_loadu_ps(m + kTile + 16 * z), _mm512_set1_ps(xs[1]), t);
          acc[r][z] = t;
        }
      }
    }
    for (int r = 0; r < std::min(R, valid); ++r)
      for (int z = 0; z < Z; ++z) _mm512_storeu_ps(y + static_cast<size_t>(r) * n + 16 * (z0 + z), acc[r][z]);
  }
}

#else

// The same arithmetic without AVX-512 VNNI, in loops the compiler vectorizes for what it has.
template <int R, int Z>
void Q4Tile(const int16_t* xq, const float* dx, const float* xsum, int k, const uint8_t* q,
            const float* scale, const float* mins, float* y, int n, int valid) {
  const int groups = k / kGroup;
  float acc[R][kTile] = {};
  for (int b = 0; b < k / 64; ++b) {
    int32_t lo[R][kTile] = {}, hi[R][kTile] = {};
    for (int i = 0; i < kBand; ++i) {
      const uint8_t* qr = q + static_cast<size_t>(b * kBand + i) * kTile;
      for (int r = 0; r < R; ++r) {
        const int32_t xl = xq[static_cast<size_t>(r) * k + 64 * b + i];
        const int32_t xh = xq[static_cast<size_t>(r) * k + 64 * b + 32 + i];
        for (int c = 0; c < kTile; ++c) {
          lo[r][c] += xl * (qr[c] & 15);
          hi[r][c] += xh * (qr[c] >> 4);
        }
      }
    }
    const float* s = scale + static_cast<size_t>(2 * b) * kTile;
    const float* m = mins + static_cast<size_t>(2 * b) * kTile;
    for (int r = 0; r < R; ++r) {
      const float d0 = dx[r * groups + 2 * b], d1 = dx[r * groups + 2 * b + 1];
      const float xs0 = xsum[r * groups + 2 * b], xs1 = xsum[r * groups + 2 * b + 1];
      for (int c = 0; c < kTile; ++c)
        acc[r][c] += lo[r][c] * d0 * s[c] + m[c] * xs0 + hi[r][c] * d1 * s[kTile + c] + m[kTile + c] * xs1;
    }
  }
  for (int r = 0; r < std::min(R, valid); ++r) std::memcpy(y + static_cast<size_t>(r) * n, acc[r], sizeof(acc[r]));
}

#endif

// One projection of the call: its layer's tiles, scales and mins, its width, its output.
struct Projection {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  int n;
  float* y;
};

// Every projection's tiles shared among the threads; each tile's rows in chunks of R (the last one
// padded with zero rows, its padding's outputs not written), the tile in cache for every chunk.
template <int R, int Z>
void Q4Rows(ffi::ThreadPool& pool, const float* x, int rows, int k, const std::vector<Projection>& projs) {
  const int groups = k / kGroup, chunks = (rows + R - 1) / R;
  const QuantizedRows xq = Quantize(x, rows, chunks * R, k);
  std::vector<int> first_unit;  // each projection's first tile's unit
  int units = 0;
  for (const Projection& p : projs) {
    first_unit.push_back(units);
    units += p.n / kTile;
  }
  ParallelFor(pool, units, [&](int unit) {
    const int j = static_cast<int>(std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin()) - 1;
    const Projection& p = projs[j];
    const size_t t = unit - first_unit[j];
    const uint8_t* q = p.q + t * (k / 2) * kTile;
    const float* s = p.scale + t * groups * kTile;
    const float* m = p.mins + t * groups * kTile;
    for (int c = 0; c < chunks; ++c) {
      const size_t r0 = static_cast<size_t>(c) * R;
      Q4Tile<R, Z>(xq.q.data() + r0 * k, xq.scale.data() + r0 * groups, xq.sum.data() + r0 * groups, k, q, s,
                   m, p.y + r0 * p.n + t * kTile, p.n, rows - static_cast<int>(r0));
    }
  });
}

// x [rows, k]; layer []; then per projection packed [layers, n / 64, k / 2, 64], scale and mins
// [layers, n / 64, k / 64, 2, 64] (remaining arguments, in threes) -> per projection y [rows, n].
// Projections that read the same x (q, k, v; gate, up) go in one call: x quantized once, one
// share-out of the tiles.
ffi::Error Q4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || args.size() != 3 * rets.size() || rets.size() == 0)
    return ffi::Error::InvalidArgument("q4_matmul: x [rows, k], then packed, scale, mins per output");
  const int rows = static_cast<int>(xd[0]), k = static_cast<int>(xd[1]), l = layer.typed_data()[0];
  if (k % 64) return ffi::Error::InvalidArgument("q4_matmul: k must be a multiple of 64");
  std::vector<Projection> projs;
  for (size_t j = 0; j < rets.size(); ++j) {
    auto packed = args.get<ffi::Buffer<ffi::U8>>(3 * j);
    auto scale = args.get<ffi::Buffer<ffi::F32>>(3 * j + 1);
    auto mins = args.get<ffi::Buffer<ffi::F32>>(3 * j + 2);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(j);
    if (!packed.has_value() || !scale.has_value() || !mins.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument("q4_matmul: packed must be uint8, scale, mins and y float32");
    const auto pd = packed->dimensions();
    if (pd.size() != 4 || pd[2] * 2 != k || pd[3] != kTile)
      return ffi::Error::InvalidArgument("q4_matmul: packed must be [layers, n / 64, k / 2, 64]");
    const int layers = static_cast<int>(pd[0]), n = static_cast<int>(pd[1]) * kTile;
    if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("q4_matmul: layer out of range");
    const size_t per_layer = static_cast<size_t>(k / 2) * n;
    projs.push_back({packed->typed_data() + l * per_layer, scale->typed_data() + l * (per_layer / 16),
                     mins->typed_data() + l * (per_layer / 16), n, (*y)->typed_data()});
  }
  const float* xp = x.typed_data();
  if (rows == 0) return ffi::Error::Success();
  if (rows == 1) Q4Rows<1, 4>(pool, xp, rows, k, projs);
  else if (rows == 2) Q4Rows<2, 4>(pool, xp, rows, k, projs);
  else if (rows <= 4) Q4Rows<4, 2>(pool, xp, rows, k, projs);
  else Q4Rows<8, 1>(pool, xp, rows, k, projs);
  return ffi::Error::Success();
}

// A tied LM head in GGUF's Q8_0 groups: y [rows, vocab] = x [rows, k] @ table [vocab, k]^T, with an
// int8 table and a float32 scale per group of 32 inputs ([vocab, k / 32]). Each table row is read once
// for all rows of x (XLA:CPU, past one row, writes a float32 copy of the whole table, or of each chunk
// of it, before its dot); x is quantized per group to int16 as above, and each group's int32 sum
// scaled by dx * scale. Vocabulary rows are shared among the threads in blocks.
constexpr int kHeadBlock = 256;  // vocabulary rows per unit of work
constexpr int kHeadRows = 4;     // rows of x whose sums stay in registers together

// y[r][v] for rows [0, R) of the quantized x and the vocabulary rows [v0, v1); R <= kHeadRows.
template <int R>
void Q8HeadRows(const QuantizedRows& xq, int r0, int k, const int8_t* w, const float* s, int v0, int v1,
                float* y, int vocab) {
  const int groups = k / kGroup;
  for (int v = v0; v < v1; ++v) {
    const int8_t* wv = w + static_cast<size_t>(v) * k;
    const float* sv = s + static_cast<size_t>(v) * groups;
#if defined(__AVX512BW__)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      const __m512i wg = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wv + g * kGroup)));
      for (int r = 0; r < R; ++r) {
        const size_t row = static_cast<size_t>(r0 + r);
        const __m512i xg = _mm512_loadu_si512(xq.q.data() + row * k + g * kGroup);
        const __m512 part = _mm512_cvtepi32_ps(_mm512_madd_epi16(wg, xg));  // 16 sums of 2 products
        acc[r] = _mm512_fmadd_ps(part, _mm512_set1_ps(xq.scale[row * groups + g] * sv[g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) y[static_cast<size_t>(r0 + r) * vocab + v] = _mm512_reduce_add_ps(acc[r]);
#else
    for (int r = 0; r < R; ++r) {
      const size_t row = static_cast<size_t>(r0 + r);
      float total = 0;
      for (int g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += static_cast<int32_t>(xq.q[row * k + g * kGroup + i]) * wv[g * kGroup + i];
        total += static_cast<float>(dot) * xq.scale[row * groups + g] * sv[g];
      }
      y[row * vocab + v] = total;
    }
#endif
  }
}

ffi::Error Q8Head(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> table,
                  ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), td = table.dimensions();
  if (xd.size() != 2 || td.size() != 2 || xd[1] != td[1] || td[1] % kGroup)
    return ffi::Error::InvalidArgument("q8_head: x [rows, k], table [vocab, k], k a multiple of 32");
  const int rows = static_cast<int>(xd[0]), k = static_cast<int>(xd[1]), vocab = static_cast<int>(td[0]);
  if (rows == 0) return ffi::Error::Success();
  const QuantizedRows xq = Quantize(x.typed_data(), rows, rows, k);
  const int8_t* w = table.typed_data();
  const float* s = scale.typed_data();
  float* out = y->typed_data();
  ParallelFor(pool, (vocab + kHeadBlock - 1) / kHeadBlock, [&](int unit) {
    const int v0 = unit * kHeadBlock, v1 = std::min(vocab, v0 + kHeadBlock);
    int r0 = 0;  // the block's table rows stay in cache while every chunk of x's rows reads them
    for (; r0 + kHeadRows <= rows; r0 += kHeadRows) Q8HeadRows<kHeadRows>(xq, r0, k, w, s, v0, v1, out, vocab);
    switch (rows - r0) {
      case 3: Q8HeadRows<3>(xq, r0, k, w, s, v0, v1, out, vocab); break;
      case 2: Q8HeadRows<2>(xq, r0, k, w, s, v0, v1, out, vocab); break;
      case 1: Q8HeadRows<1>(xq, r0, k, w, s, v0, v1, out, vocab); break;
      default: break;
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQ8Head, jaxserve::Q8Head,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S8>>()   // table
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQ4Matmul, jaxserve::Q4Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .RemainingArgs()                         // (packed, scale, mins) each
                                  .RemainingRets());                       // y each
