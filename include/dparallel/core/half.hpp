#pragma once
// Host 16-bit floating-point storage types: dparallel::f16 (IEEE binary16) and dparallel::bf16
// (bfloat16, the upper half of a binary32). They hold bits and convert to and from float; the
// arithmetic happens in float (every dparallel reduction of them accumulates in float and rounds
// once at the end). No CUDA header: they are the host's counterparts of __half and __nv_bfloat16,
// with the same dtype tags (dtype::f16, dtype::bf16) and the same bits, so a buffer of either can
// be viewed as the other, and both mappings can live in one translation unit.
//
// Conversions, as IEEE 754 and CUDA's __float2half_rn / __float2bfloat16_rn compute them:
//  - 16-bit -> float is exact (subnormals included; a NaN keeps its sign and payload, quieted);
//  - float -> 16-bit rounds to nearest, ties to even; values beyond the largest finite value
//    round to infinity (as IEEE's roundTiesToEven does); subnormal results are kept (f16 has them
//    below 2^-14; bf16 shares float's exponent range); signed zeros and infinities are kept;
//  - every NaN becomes the canonical quiet NaN 0x7FFF (CUDA's conversions give the same bits).

#include <dparallel/config.hpp>
#include <dparallel/core/dtype.hpp>

#include <bit>
#include <cstdint>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

/// The float of bf16 bits `h`: exact (bf16 is a truncated float).
constexpr float bf16_bits_to_float(std::uint16_t h) noexcept {
  std::uint32_t x = static_cast<std::uint32_t>(h) << 16;
  if ((x & 0x7fffffffu) > 0x7f800000u) x |= 0x00400000u;  // NaN: quiet it, keep sign and payload
  return std::bit_cast<float>(x);
}

/// The bf16 bits nearest to `f` (ties to even); NaN gives 0x7FFF.
constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  std::uint32_t const x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  std::uint32_t const bias = 0x7fffu + ((x >> 16) & 1u);  // ties to even; overflow carries to infinity
  return static_cast<std::uint16_t>((x + bias) >> 16);
}

/// The float of f16 bits `h`: exact.
constexpr float f16_bits_to_float(std::uint16_t h) noexcept {
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const exp = (h >> 10) & 0x1fu;
  std::uint32_t const mant = h & 0x3ffu;
  if (exp == 0x1f) {  // infinity, or NaN (quieted, payload kept)
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x00400000u : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    float const v = static_cast<float>(mant) * 0x1p-24f;
    return sign != 0 ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// The f16 bits nearest to `f` (ties to even; beyond 65504 to infinity); NaN gives 0x7FFF.
/// Normal results: the exponent is rebiased and the 13 dropped mantissa bits rounded to nearest
/// even in one integer addition (a carry moves to the next binade, or to infinity). Results below
/// 2^-14 (subnormal or zero): float's own rounding does it, adding 0.5f, whose ulp (2^-24) is
/// the f16 subnormal unit.
constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  std::uint32_t const bits = std::bit_cast<std::uint32_t>(f);
  auto const sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  std::uint32_t const x = bits & 0x7fffffffu;
  if (x >= 0x47800000u) return x > 0x7f800000u ? std::uint16_t{0x7fff} : static_cast<std::uint16_t>(sign | 0x7c00u);
  if (x < 0x38800000u) {
    float const v = std::bit_cast<float>(x) + 0.5f;
    return static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(v) - 0x3f000000u));
  }
  std::uint32_t const odd = (x >> 13) & 1u;
  std::uint32_t const rebiased = x - (112u << 23) + 0xfffu + odd;
  return static_cast<std::uint16_t>(sign | (rebiased >> 13));
}

}  // namespace detail

/// A 16-bit floating-point storage type: IEEE binary16 (`Brain` false: dparallel::f16, the bits
/// of CUDA's __half) or bfloat16 (`Brain` true: dparallel::bf16, the bits of __nv_bfloat16).
/// Convert to float to compute; construct from float to round (ties to even).
template <bool Brain>
struct basic_half {
  /// The raw bits: sign, then 5 exponent and 10 mantissa bits (f16) or 8 and 7 (bf16, the upper
  /// half of a float).
  std::uint16_t bits = 0;

  /// Positive zero.
  constexpr basic_half() noexcept = default;
  /// The value nearest to `v` (ties to even; NaN becomes 0x7FFF).
  constexpr explicit basic_half(float v) noexcept
      : bits(Brain ? detail::float_to_bf16_bits(v) : detail::float_to_f16_bits(v)) {}
  /// The value with bits `b`.
  [[nodiscard]] static constexpr basic_half from_bits(std::uint16_t b) noexcept {
    basic_half h;
    h.bits = b;
    return h;
  }
  /// The exact float value.
  constexpr explicit operator float() const noexcept {
    return Brain ? detail::bf16_bits_to_float(bits) : detail::f16_bits_to_float(bits);
  }
  /// Bitwise equality (not IEEE comparison: NaNs with equal bits compare equal, +0 != -0).
  friend constexpr bool operator==(basic_half a, basic_half b) noexcept { return a.bits == b.bits; }
};

/// IEEE binary16 storage (dtype::f16): 2 bytes, the same bits as CUDA's __half.
using f16 = basic_half<false>;
/// bfloat16 storage (dtype::bf16): 2 bytes, the same bits as CUDA's __nv_bfloat16.
using bf16 = basic_half<true>;

static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2, "dparallel: f16 and bf16 must be 2-byte storage types");

/// `dparallel::f16` is dtype::f16, `dparallel::bf16` dtype::bf16.
template <bool Brain>
struct dtype_of<basic_half<Brain>> {
  /// The dtype tag.
  static constexpr dtype value = Brain ? dtype::bf16 : dtype::f16;
};

namespace detail {

/// The type host reductions of T accumulate in: float for f16 and bf16, T itself otherwise.
template <class T>
struct accumulator {
  /// T itself.
  using type = T;
};
/// f16 and bf16 accumulate in float.
template <bool Brain>
struct accumulator<basic_half<Brain>> {
  /// float.
  using type = float;
};
/// accumulator<T>::type.
template <class T>
using accumulator_t = typename accumulator<T>::type;

/// x in its accumulation type (exact).
template <class T>
constexpr accumulator_t<T> widen(T x) noexcept {
  return static_cast<accumulator_t<T>>(x);
}
/// An accumulated value stored as T (rounded to nearest even for the 16-bit types).
template <class T>
constexpr T narrow(accumulator_t<T> v) noexcept {
  return T(v);
}

/// True for the 16-bit floating dtypes.
constexpr bool is_half(dtype t) noexcept { return t == dtype::f16 || t == dtype::bf16; }

}  // namespace detail

DPARALLEL_NAMESPACE_END
