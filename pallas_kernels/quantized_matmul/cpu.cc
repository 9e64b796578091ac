// x @ W for a few rows of x and a 4-bit kernel W, reading W's bytes once (see native.py for why).
//
// W is one layer of a stack [layers, k / 2, n] in layers/linear.py's 4-bit layout: byte row 32b + i
// holds input 64b + i in its low nibble and input 64b + 32 + i in its high one, and
// w = q * scale + min with a scale and a min per group of 32 inputs ([layers, k / 64, 2, n]). Taking
// the whole stack and the layer index spares XLA a copy of the layer's slice before the call.
//
// Per group, sum_i x_i (q_i s + m) = s (sum_i x_i q_i) + m (sum_i x_i): the inner loop is one
// multiply-add per weight on the unpacked nibbles, and the scale and min apply once per group.
// The reference: quantized_matmul/reference.py, q4_matmul_reference (same arguments).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "native.h"

namespace jaxserve {
namespace {

constexpr int kGroup = 32;  // inputs per scale and min
constexpr int kCols = 64;   // output columns per unit of work: one cache line of each byte row
// Byte rows read ahead. A unit reads one cache line per row, rows n bytes apart: the hardware's
// stride prefetchers stop at each 4 KiB page, which rows of a wide kernel cross every few rows.
constexpr int kAhead = 16;

// y[r, c0:c0 + C] for R rows of x. The R * C partial sums of both nibbles stay in registers, so C
// shrinks as R grows.
template <int R, int C>
void Q4Block(const float* x, const float* xsum, int k, int n, const uint8_t* q, const float* scale,
             const float* mins, float* y, int c0) {
  float acc[R][C] = {};
  const int groups = k / kGroup;
  for (int b = 0; b < k / 64; ++b) {
    float lo[R][C] = {}, hi[R][C] = {};
    const uint8_t* qb = q + static_cast<size_t>(b) * 32 * n + c0;
    for (int i = 0; i < 32; ++i) {
      const uint8_t* qr = qb + static_cast<size_t>(i) * n;
      if (32 * b + i + kAhead < k / 2) __builtin_prefetch(qr + static_cast<size_t>(kAhead) * n);
      float wl[C], wh[C];
      for (int c = 0; c < C; ++c) {
        wl[c] = static_cast<float>(qr[c] & 15);
        wh[c] = static_cast<float>(qr[c] >> 4);
      }
      for (int r = 0; r < R; ++r) {
        const float xl = x[r * k + 64 * b + i], xh = x[r * k + 64 * b + 32 + i];
        for (int c = 0; c < C; ++c) {
          lo[r][c] += xl * wl[c];
          hi[r][c] += xh * wh[c];
        }
      }
    }
    const float* s0 = scale + static_cast<size_t>(2 * b) * n + c0;  // [2, n]: low nibbles' first
    const float* m0 = mins + static_cast<size_t>(2 * b) * n + c0;
    for (int r = 0; r < R; ++r) {
      const float xs0 = xsum[r * groups + 2 * b], xs1 = xsum[r * groups + 2 * b + 1];
      for (int c = 0; c < C; ++c)
        acc[r][c] += s0[c] * lo[r][c] + m0[c] * xs0 + s0[n + c] * hi[r][c] + m0[n + c] * xs1;
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + static_cast<size_t>(r) * n + c0, acc[r], sizeof(acc[r]));
}

// One projection of the call: its layer's bytes, scales and mins, its width, its output.
struct Projection {
  const uint8_t* q;
  const float* scale;
  const float* mins;
  int n;
  float* y;
};

// The rows in chunks of R (the last one padded with zero rows), every projection's columns in
// blocks of kCols: all the units of the call shared among the threads.
template <int R, int C>
void Q4Rows(ffi::ThreadPool& pool, const float* x, int rows, int k, const std::vector<Projection>& projs) {
  const int groups = k / kGroup, chunks = (rows + R - 1) / R;
  std::unique_ptr<float[]> xs(new float[static_cast<size_t>(chunks) * R * (k + groups)]());
  float* xpad = xs.get();
  float* xsum = xpad + static_cast<size_t>(chunks) * R * k;
  std::memcpy(xpad, x, sizeof(float) * rows * k);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < groups; ++g) {
      float s = 0;
      for (int i = 0; i < kGroup; ++i) s += x[r * k + g * kGroup + i];
      xsum[r * groups + g] = s;
    }
  std::vector<int> first_unit;  // each projection's first unit
  std::vector<std::unique_ptr<float[]>> padded;  // outputs of whole row chunks, when rows fall short
  int units = 0;
  for (const Projection& p : projs) {
    first_unit.push_back(units);
    units += chunks * (p.n / kCols);
    padded.emplace_back(rows % R ? new float[static_cast<size_t>(chunks) * R * p.n] : nullptr);
  }
  ParallelFor(pool, units, [&](int unit) {
    const int j = static_cast<int>(std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin()) - 1;
    const Projection& p = projs[j];
    const int blocks = p.n / kCols, local = unit - first_unit[j];
    const int chunk = local / blocks, c0 = (local % blocks) * kCols;
    float* y = (padded[j] ? padded[j].get() : p.y) + static_cast<size_t>(chunk) * R * p.n;
    for (int c = 0; c < kCols; c += C)
      Q4Block<R, C>(xpad + chunk * R * k, xsum + chunk * R * groups, k, p.n, p.q, p.scale, p.mins, y, c0 + c);
  });
  for (size_t j = 0; j < projs.size(); ++j)
    if (padded[j]) std::memcpy(projs[j].y, padded[j].get(), sizeof(float) * rows * projs[j].n);
}

// x [rows, k]; layer []; then per projection packed [layers, k / 2, n], scale and mins
// [layers, k / 64, 2, n] (remaining arguments, in threes) -> per projection y [rows, n]. Projections
// that read the same x (q, k, v; gate, up) go in one call: one pass over x, one share-out.
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
    if (pd.size() != 3 || pd[1] * 2 != k || pd[2] % kCols)
      return ffi::Error::InvalidArgument("q4_matmul: packed must be [layers, k / 2, n], n a multiple of 64");
    const int layers = static_cast<int>(pd[0]), n = static_cast<int>(pd[2]);
    if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("q4_matmul: layer out of range");
    projs.push_back({packed->typed_data() + static_cast<size_t>(l) * (k / 2) * n,
                     scale->typed_data() + static_cast<size_t>(l) * (k / kGroup) * n,
                     mins->typed_data() + static_cast<size_t>(l) * (k / kGroup) * n, n, (*y)->typed_data()});
  }
  const float* xp = x.typed_data();
  if (rows == 0) return ffi::Error::Success();
  if (rows == 1) Q4Rows<1, 64>(pool, xp, rows, k, projs);
  else if (rows == 2) Q4Rows<2, 64>(pool, xp, rows, k, projs);
  else if (rows <= 4) Q4Rows<4, 32>(pool, xp, rows, k, projs);
  else Q4Rows<8, 16>(pool, xp, rows, k, projs);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQ4Matmul, jaxserve::Q4Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // layer
                                  .RemainingArgs()                         // (packed, scale, mins) each
                                  .RemainingRets());                       // y each
