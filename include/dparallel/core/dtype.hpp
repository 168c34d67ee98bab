#pragma once
// Element types that dparallel moves and reduces, and the mapping from C++ types to them.

#include <dparallel/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

/// Runtime tag of an element type. f16/bf16 become usable when the CUDA backend is included.
enum class dtype : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8 };

/// Size in bytes of one element of `t`.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return 4;
    case dtype::f64: return 8;
    case dtype::f16: return 2;
    case dtype::bf16: return 2;
    case dtype::i32: return 4;
    case dtype::i64: return 8;
    case dtype::u8: return 1;
  }
  return 0;
}

/// Name of `t` as safetensors spells it ("F32", "BF16", ...).
constexpr std::string_view name_of(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::f64: return "F64";
    case dtype::f16: return "F16";
    case dtype::bf16: return "BF16";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
  }
  return "?";
}

/// dtype_of<T>::value names the dtype of T; specialised here for the host types and by the
/// CUDA backend for __half and __nv_bfloat16.
template <class T>
struct dtype_of;
/// `float` is dtype::f32.
template <>
struct dtype_of<float> {
  /// The dtype tag of `float`.
  static constexpr dtype value = dtype::f32;
};
/// `double` is dtype::f64.
template <>
struct dtype_of<double> {
  /// The dtype tag of `double`.
  static constexpr dtype value = dtype::f64;
};
/// `std::int32_t` is dtype::i32.
template <>
struct dtype_of<std::int32_t> {
  /// The dtype tag of `std::int32_t`.
  static constexpr dtype value = dtype::i32;
};
/// `std::int64_t` is dtype::i64.
template <>
struct dtype_of<std::int64_t> {
  /// The dtype tag of `std::int64_t`.
  static constexpr dtype value = dtype::i64;
};
/// `std::uint8_t` is dtype::u8.
template <>
struct dtype_of<std::uint8_t> {
  /// The dtype tag of `std::uint8_t`.
  static constexpr dtype value = dtype::u8;
};

/// A type dparallel can describe with a dtype.
template <class T>
concept element = requires { dtype_of<T>::value; };

template <element T>
inline constexpr dtype dtype_v = dtype_of<T>::value;

DPARALLEL_NAMESPACE_END
