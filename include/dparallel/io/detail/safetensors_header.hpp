#pragma once
// The header of a safetensors file: the public types that describe it (included by
// <dparallel/io/safetensors.hpp>, which is the header to include) and the code that writes and
// reads it. Reading is one pass of a streaming JSON cursor (detail::json::cursor) that keeps only
// what a reader needs (names, dtypes, shapes, offsets and the metadata strings) and skips every
// other value without building it: the memory a header costs is a small multiple of its size.
//
// What the reader accepts beyond what the writer produces, as the reference implementation does:
// whitespace before the opening '{', "__metadata__": null, keys it does not know (skipped), and
// tensors of the safetensors dtypes dparallel does not handle (BOOL, I8, I16, U16, U32, U64, the
// F8 kinds, C64): those are validated like the others and listed apart (unsupported_tensor).
// Duplicate keys stay an error: RFC 8259 leaves their meaning open and JSON readers differ on
// which one wins, so two tools could read different tensors from the same file.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/detail/json.hpp>
#include <dparallel/core/detail/printable.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Largest header the reader accepts (100,000,000 bytes, the reference implementation's limit):
/// a bigger length field means a corrupt file, not a big model.
inline constexpr std::uint64_t max_safetensors_header = 100'000'000;

/// The `__metadata__` of a file: free-form string pairs.
using safetensors_metadata = std::map<std::string, std::string>;

/// A tensor to save: its name, its data (host memory) and, optionally, its shape. Without a shape
/// it is saved as a 1-D tensor of data.size() elements.
struct named_tensor {
  /// The tensor's name in the file.
  std::string name;
  /// Its elements.
  tensor_ref data;
  /// Its shape; without one the tensor is written as [size].
  std::optional<std::vector<std::uint64_t>> shape{};
};

/// One tensor as the header of a file describes it.
struct tensor_info {
  /// The tensor's name in the file.
  std::string name;
  /// Its dtype.
  dparallel::dtype type = dtype::f32;
  /// Its shape.
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  ///< first byte, relative to the data section
  std::uint64_t end = 0;    ///< one past the last byte

  /// Number of elements (the product of the shape; 1 for a scalar).
  [[nodiscard]] std::uint64_t elements() const noexcept {
    std::uint64_t n = 1;
    for (auto d : shape) n *= d;  // validated not to overflow when read
    return n;
  }
  /// Number of bytes of data.
  [[nodiscard]] std::uint64_t size_bytes() const noexcept { return end - begin; }
};

/// A tensor of a safetensors dtype dparallel does not handle (BOOL, I8, I16, U16, U32, U64, the F8
/// kinds, C64): validated like the others, never read.
struct unsupported_tensor {
  /// The tensor's name in the file.
  std::string name;
  std::string dtype;  ///< as the file names it ("BOOL", "F8_E4M3", ...)
  std::uint64_t begin = 0;  ///< first byte, relative to the data section
  std::uint64_t end = 0;    ///< one past the last byte
};

/// The dtype safetensors names `name` ("F32", "BF16", ...), or nothing for a dtype dparallel does
/// not handle (BOOL, I8, I16, U16, U32, U64, the F8 kinds).
constexpr std::optional<dtype> dtype_from_name(std::string_view name) noexcept {
  for (dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16, dtype::i32, dtype::i64, dtype::u8})
    if (name_of(t) == name) return t;
  return std::nullopt;
}

namespace detail {

/// Bytes per element of the safetensors dtypes dparallel does not handle, 0 for a name that is
/// no safetensors dtype at all.
constexpr std::uint64_t unsupported_dtype_size(std::string_view name) noexcept {
  constexpr std::pair<std::string_view, std::uint64_t> table[] = {
      {"BOOL", 1}, {"I8", 1},      {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"I16", 2},
      {"U16", 2},  {"U32", 4},     {"U64", 8},     {"C64", 8}};
  for (auto const& [n, size] : table)
    if (n == name) return size;
  return 0;
}

inline std::string shape_string(std::vector<std::uint64_t> const& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s.append(", ");
    s.append(std::to_string(shape[i]));
  }
  s.push_back(']');
  return s;
}

/// a * b, or false when it overflows 64 bits.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

/// The header JSON of `tensors` (written in the given order, data back to back) and `metadata`,
/// padded with spaces so that the data section starts at a multiple of 8 bytes. Validates names,
/// shapes, devices and metadata; `where` names the file in messages.
inline std::string make_safetensors_header(std::span<named_tensor const> tensors, safetensors_metadata const& metadata,
                                           std::string const& where) {
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h.append("\"__metadata__\":{");
    bool first_entry = true;
    for (auto const& [k, v] : metadata) {
      if (!json::valid_utf8(k) || !json::valid_utf8(v))
        throw invalid_argument("dparallel: save " + where + ": expected metadata in UTF-8, found the key " +
                               in_quotes(k) + " or its value not valid UTF-8");
      if (!first_entry) h.push_back(',');
      first_entry = false;
      json::write_string(h, k);
      h.push_back(':');
      json::write_string(h, v);
    }
    h.push_back('}');
    first = false;
  }
  std::uint64_t offset = 0;
  std::unordered_map<std::string_view, std::size_t> seen;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto const& t = tensors[i];
    detail::require(t.name != "__metadata__", [&] {
      return "save " + where + ": the tensor name '__metadata__' is reserved by the safetensors format; rename the "
                               "tensor";
    });
    detail::require(json::valid_utf8(t.name), [&] {
      return "save " + where + ": expected tensor names in UTF-8, found tensor " + std::to_string(i) +
             "'s name not valid UTF-8";
    });
    auto const inserted = seen.emplace(t.name, i);
    detail::require(inserted.second, [&] {
      return "save " + where + ": expected unique tensor names, found " + in_quotes(t.name) + " at positions " +
             std::to_string(inserted.first->second) + " and " + std::to_string(i);
    });
    detail::require(t.data.device().kind == device_kind::host, [&] {
      return "save " + where + ": tensor " + in_quotes(t.name) + " is in " + to_string(t.data.device()) +
             " memory; only host memory can be written: copy it to the host first";
    });
    detail::require(t.data.size() == 0 || t.data.data() != nullptr, [&] {
      return "save " + where + ": tensor " + in_quotes(t.name) + " has " + std::to_string(t.data.size()) +
             " elements and a null data pointer";
    });
    std::vector<std::uint64_t> const shape = t.shape.value_or(std::vector<std::uint64_t>{t.data.size()});
    std::uint64_t n = 1;
    bool ok = true;
    for (auto d : shape) ok = ok && checked_mul(n, d, n);
    detail::require(ok && n == t.data.size(), [&] {
      return "save " + where + ": tensor " + in_quotes(t.name) + " has shape " + shape_string(shape) +
             ", which does not hold its " + std::to_string(t.data.size()) + " elements";
    });
    if (!first) h.push_back(',');
    first = false;
    json::write_string(h, t.name);
    h.append(":{\"dtype\":\"");
    h.append(name_of(t.data.dtype()));
    h.append("\",\"shape\":[");
    for (std::size_t k = 0; k < shape.size(); ++k) {
      if (k != 0) h.push_back(',');
      h.append(std::to_string(shape[k]));
    }
    std::uint64_t const end = offset + t.data.size_bytes();
    h.append("],\"data_offsets\":[");
    h.append(std::to_string(offset));
    h.push_back(',');
    h.append(std::to_string(end));
    h.append("]}");
    offset = end;
  }
  h.push_back('}');
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

/// What a header holds.
struct parsed_header {
  std::vector<tensor_info> tensors;          ///< in file order (by offset)
  std::vector<unsupported_tensor> unsupported;  ///< in file order
  safetensors_metadata metadata;
};

/// Reads and validates the header JSON `text` against a data section of `data_size` bytes.
/// Throws dparallel::error naming the file (`where`, quoted) and the fault.
inline parsed_header parse_safetensors_header(std::string_view text, std::uint64_t data_size, std::string const& where) {
  auto fail = [&](std::string const& what) -> error {
    return error("dparallel: " + where + ": " + what + "; the file is corrupt or not a safetensors file");
  };
  json::cursor in(text, where);
  if (in.peek() != '{') throw fail("expected the header to start with '{' (a JSON object), found " + in.found());
  in.expect('{');
  parsed_header out;
  std::vector<std::uint64_t> scratch_shape;
  bool have_metadata = false;
  for (bool first = true; in.more('}', first);) {
    std::size_t const at = in.offset();
    std::string name = in.key();
    if (name == "__metadata__") {
      if (have_metadata) in.fail(at, "duplicate key \"__metadata__\"");
      have_metadata = true;
      if (in.null()) continue;
      if (in.peek() != '{') throw fail("expected __metadata__ to be an object or null, found " + in.found());
      in.expect('{');
      for (bool first_entry = true; in.more('}', first_entry);) {
        std::size_t const key_pos = in.offset();
        std::string k = in.key();
        if (in.peek() != '"')
          throw fail("expected the __metadata__ value of " + in_quotes(k) + " to be a string, found " + in.found());
        if (!out.metadata.emplace(std::move(k), in.string()).second)
          in.fail(key_pos, "duplicate key in __metadata__");
      }
      continue;
    }
    std::string const what = "tensor " + in_quotes(name);
    if (in.peek() != '{') throw fail("expected " + what + " to be an object, found " + in.found());
    in.expect('{');
    std::optional<std::string> dt;
    bool have_shape = false, have_offsets = false;
    std::uint64_t begin = 0, end = 0, elements = 1;
    scratch_shape.clear();
    for (bool first_field = true; in.more('}', first_field);) {
      std::size_t const field_at = in.offset();
      std::string const field = in.key();
      bool const dup = (field == "dtype" && dt) || (field == "shape" && have_shape) ||
                       (field == "data_offsets" && have_offsets);
      if (dup) in.fail(field_at, "duplicate key \"" + field + "\" in " + what);
      if (field == "dtype") {
        if (in.peek() != '"') throw fail("expected the dtype of " + what + " to be a string, found " + in.found());
        dt = in.string();
      } else if (field == "shape") {
        have_shape = true;
        if (in.peek() != '[') throw fail("expected the shape of " + what + " to be an array, found " + in.found());
        in.expect('[');
        for (bool first_dim = true; in.more(']', first_dim);) {
          char const c = in.peek();
          std::uint64_t dim = 0;
          std::string_view written;
          if ((c != '-' && (c < '0' || c > '9')) || !in.u64(dim, written))
            throw fail("expected the shape of " + what + " to hold non-negative integers, found " +
                       (written.empty() ? in.found() : "'" + std::string(written) + "'"));
          if (!checked_mul(elements, dim, elements)) throw fail("the shape of " + what + " has more elements than 2^64");
          scratch_shape.push_back(dim);
        }
      } else if (field == "data_offsets") {
        have_offsets = true;
        auto const bad = [&] {
          return fail("expected the data_offsets of " + what + " to be two non-negative integers [begin, end]");
        };
        if (in.peek() != '[') throw bad();
        in.expect('[');
        std::size_t count = 0;
        for (bool first_off = true; in.more(']', first_off); ++count) {
          char const c = in.peek();
          std::uint64_t v = 0;
          std::string_view written;
          if (count >= 2 || (c != '-' && (c < '0' || c > '9')) || !in.u64(v, written)) throw bad();
          (count == 0 ? begin : end) = v;
        }
        if (count != 2) throw bad();
      } else {
        in.skip_value(2);  // a key the format does not define: skipped, as the reference does
      }
    }
    if (!dt || !have_shape || !have_offsets)
      throw fail("expected " + what + " to have \"dtype\", \"shape\" and \"data_offsets\", found " +
                 (!dt ? "no \"dtype\"" : !have_shape ? "no \"shape\"" : "no \"data_offsets\""));
    auto const type = dtype_from_name(*dt);
    std::uint64_t const elem_size = type ? size_of(*type) : unsupported_dtype_size(*dt);
    if (elem_size == 0)
      throw fail(what + " has dtype " + in_quotes(*dt) +
                 ", which is not a safetensors dtype (dparallel reads F32, F64, F16, BF16, I32, I64 and U8, and "
                 "skips BOOL, I8, I16, U16, U32, U64, C64 and the F8 kinds)");
    std::uint64_t bytes = 0;
    if (!checked_mul(elements, elem_size, bytes)) throw fail("the shape of " + what + " has more bytes than 2^64");
    auto const offsets_text = [&] { return "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]"; };
    if (end < begin) throw fail(what + " has " + offsets_text() + ", which end before they begin");
    if (end > data_size)
      throw fail(what + " has " + offsets_text() + " outside the data section of " + std::to_string(data_size) +
                 " bytes (the file is truncated?)");
    if (end - begin != bytes)
      throw fail(what + " has dtype " + printable(*dt) + " and shape " + shape_string(scratch_shape) + " (" +
                 std::to_string(bytes) + " bytes) but " + offsets_text() + " (" + std::to_string(end - begin) +
                 " bytes)");
    if (type) {
      out.tensors.push_back(tensor_info{std::move(name), *type, scratch_shape, begin, end});
    } else {
      out.unsupported.push_back(unsupported_tensor{std::move(name), std::move(*dt), begin, end});
    }
  }
  if (!in.at_end()) in.fail(in.offset(), "unexpected text after the end of the JSON value");

  // Names must be unique: sort references to all of them (supported and not) and compare neighbours.
  struct entry {
    std::string_view name;
    std::uint64_t begin, end;
  };
  std::vector<entry> all;
  all.reserve(out.tensors.size() + out.unsupported.size());
  for (auto const& t : out.tensors) all.push_back({t.name, t.begin, t.end});
  for (auto const& t : out.unsupported) all.push_back({t.name, t.begin, t.end});
  std::sort(all.begin(), all.end(), [](entry const& a, entry const& b) { return a.name < b.name; });
  for (std::size_t i = 1; i < all.size(); ++i)
    if (all[i].name == all[i - 1].name) throw fail("duplicate key \"" + printable(all[i].name) + "\": a tensor name may appear once");

  // The tensors must tile the data section: no overlap, no hole, nothing after the last one.
  std::stable_sort(all.begin(), all.end(), [](entry const& a, entry const& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected = 0;
  std::string_view previous;
  for (auto const& t : all) {
    if (t.begin < expected)
      throw fail("tensor " + in_quotes(t.name) + " (bytes " + std::to_string(t.begin) + " to " + std::to_string(t.end) +
                 ") overlaps tensor " + in_quotes(previous));
    if (t.begin > expected)
      throw fail("bytes " + std::to_string(expected) + " to " + std::to_string(t.begin) +
                 " of the data section belong to no tensor");
    expected = t.end;
    previous = t.name;
  }
  if (expected != data_size)
    throw fail("the data section has " + std::to_string(data_size) + " bytes but its tensors cover " +
               std::to_string(expected));
  auto const by_offset = [](auto const& a, auto const& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  };
  std::stable_sort(out.tensors.begin(), out.tensors.end(), by_offset);
  std::stable_sort(out.unsupported.begin(), out.unsupported.end(), by_offset);
  return out;
}

}  // namespace detail

DPARALLEL_NAMESPACE_END
