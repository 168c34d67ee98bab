#pragma once
// The safetensors file format (the format PyTorch's safetensors package and the Hugging Face
// tools read and write), for named tensors in host memory.
//
//   std::vector<float> w(12), b(3);
//   dparallel::save_safetensors("weights.safetensors", {{"fc.weight", dparallel::view(w), {{3, 4}}},
//                                                       {"fc.bias", dparallel::view(b)}});
//   dparallel::safetensors_reader file("weights.safetensors");    // validates the whole header
//   for (auto const& t : file.tensors()) std::cout << t.name << ' ' << dparallel::name_of(t.type) << '\n';
//   file.read(*file.find("fc.bias"), dparallel::view(b));
//
// Layout: an unsigned little-endian 64-bit header length N; N bytes of JSON,
//   {"__metadata__": {"key": "value", ...},                      (optional, strings only)
//    "name": {"dtype": "F32", "shape": [3, 4], "data_offsets": [begin, end]}, ...}
// padded with spaces; then the data section, where tensor `name` occupies bytes [begin, end)
// (little-endian, row-major). The reader rejects, with a dparallel::error naming the file and
// the fault, anything else: a file shorter than its header, a header length above
// max_safetensors_header, invalid JSON or UTF-8, a dtype dparallel does not know, a shape whose
// size disagrees with the offsets, offsets outside the data section, overlapping tensors, bytes
// of the data section no tensor covers, and names that appear twice.
//
// Writes are atomic (see detail::write_file_atomically): a failed save leaves the previous file.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/detail/atomic_file.hpp>
#include <dparallel/io/detail/json.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

/// Largest header the reader accepts (100 MiB, as the reference implementation): a bigger length
/// field means a corrupt file, not a big model.
inline constexpr std::uint64_t max_safetensors_header = 100ull * 1024 * 1024;

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

/// The dtype safetensors names `name` ("F32", "BF16", ...), or nothing for a dtype dparallel does
/// not handle (BOOL, I8, I16, U16, U32, U64, the F8 kinds).
constexpr std::optional<dtype> dtype_from_name(std::string_view name) noexcept {
  for (dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16, dtype::i32, dtype::i64, dtype::u8})
    if (name_of(t) == name) return t;
  return std::nullopt;
}

namespace detail {

inline void require_little_endian() {
  if constexpr (std::endian::native != std::endian::little)
    throw error("dparallel: safetensors files are little-endian and this machine is not; converting the byte "
                "order is not implemented");
}

inline std::string shape_string(std::vector<std::uint64_t> const& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i != 0 ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// a * b, or false when it overflows 64 bits.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

inline std::string single_quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

/// The header JSON of `tensors` (written in the given order, data back to back) and `metadata`,
/// padded with spaces so that the data section starts at a multiple of 8 bytes. Validates names,
/// shapes, devices and metadata; `where` names the file in messages.
inline std::string make_safetensors_header(std::span<named_tensor const> tensors, safetensors_metadata const& metadata,
                                           std::string const& where) {
  std::string h = "{";
  bool first = true;
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    bool first_entry = true;
    for (auto const& [k, v] : metadata) {
      detail::require(json::valid_utf8(k) && json::valid_utf8(v),
                      "save " + where + ": expected metadata in UTF-8, found the key " + single_quoted(k) +
                          " or its value not valid UTF-8");
      if (!first_entry) h += ',';
      first_entry = false;
      json::write_string(h, k);
      h += ':';
      json::write_string(h, v);
    }
    h += '}';
    first = false;
  }
  std::uint64_t offset = 0;
  std::unordered_map<std::string_view, std::size_t> seen;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto const& t = tensors[i];
    detail::require(t.name != "__metadata__", "save " + where + ": the tensor name '__metadata__' is reserved by the "
                                                                "safetensors format; rename the tensor");
    detail::require(json::valid_utf8(t.name), "save " + where + ": expected tensor names in UTF-8, found tensor " +
                                                  std::to_string(i) + "'s name not valid UTF-8");
    auto const [first_at, unique] = seen.emplace(t.name, i);
    detail::require(unique, "save " + where + ": expected unique tensor names, found " + single_quoted(t.name) +
                                " at positions " + std::to_string(first_at->second) + " and " + std::to_string(i));
    detail::require(t.data.device().kind == device_kind::host,
                    "save " + where + ": tensor " + single_quoted(t.name) + " is in " + to_string(t.data.device()) +
                        " memory; only host memory can be written: copy it to the host first");
    detail::require(t.data.size() == 0 || t.data.data() != nullptr,
                    "save " + where + ": tensor " + single_quoted(t.name) + " has " + std::to_string(t.data.size()) +
                        " elements and a null data pointer");
    std::vector<std::uint64_t> const shape = t.shape.value_or(std::vector<std::uint64_t>{t.data.size()});
    std::uint64_t n = 1;
    bool ok = true;
    for (auto d : shape) ok = ok && checked_mul(n, d, n);
    detail::require(ok && n == t.data.size(), "save " + where + ": tensor " + single_quoted(t.name) + " has shape " +
                                                  shape_string(shape) + ", which does not hold its " +
                                                  std::to_string(t.data.size()) + " elements");
    if (!first) h += ',';
    first = false;
    json::write_string(h, t.name);
    h += ":{\"dtype\":\"";
    h += name_of(t.data.dtype());
    h += "\",\"shape\":[";
    for (std::size_t k = 0; k < shape.size(); ++k) {  // appended piece by piece: `"," + to_string(..)`
      if (k != 0) h += ',';                             // trips GCC 12's -Wrestrict at -O3
      h += std::to_string(shape[k]);
    }
    std::uint64_t const end = offset + t.data.size_bytes();
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]}";
    offset = end;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  return h;
}

/// Validates a parsed header against a data section of `data_size` bytes; returns the tensors in
/// file order (by offset) and fills `metadata`.
inline std::vector<tensor_info> check_safetensors_header(json::value const& root, std::uint64_t data_size,
                                                         safetensors_metadata& metadata, std::string const& where) {
  auto fail = [&](std::string const& what) -> error {
    return error("dparallel: " + where + ": " + what + "; the file is corrupt or not a safetensors file");
  };
  if (!root.is_object())
    throw fail("expected the header to be a JSON object, found " + std::string(json::kind_name(root.type)));
  std::vector<tensor_info> out;
  out.reserve(root.members.size());
  for (auto const& [name, v] : root.members) {
    if (name == "__metadata__") {
      if (!v.is_object())
        throw fail("expected __metadata__ to be an object, found " + std::string(json::kind_name(v.type)));
      for (auto const& [k, s] : v.members) {
        if (!s.is_string())
          throw fail("expected the __metadata__ value of " + single_quoted(k) + " to be a string, found " +
                     json::kind_name(s.type));
        metadata.emplace(k, s.text);
      }
      continue;
    }
    std::string const what = "tensor " + single_quoted(name);
    if (!v.is_object()) throw fail("expected " + what + " to be an object, found " + json::kind_name(v.type));
    tensor_info t;
    t.name = name;
    json::value const* dt = v.find("dtype");
    json::value const* shape = v.find("shape");
    json::value const* offsets = v.find("data_offsets");
    if (dt == nullptr || shape == nullptr || offsets == nullptr)
      throw fail("expected " + what + " to have \"dtype\", \"shape\" and \"data_offsets\", found " +
                 (dt == nullptr ? "no \"dtype\"" : shape == nullptr ? "no \"shape\"" : "no \"data_offsets\""));
    if (!dt->is_string()) throw fail("expected the dtype of " + what + " to be a string");
    auto const type = dtype_from_name(dt->text);
    if (!type)
      throw error("dparallel: " + where + ": " + what + " has dtype " + single_quoted(dt->text) +
                  ", which dparallel does not handle (it reads F32, F64, F16, BF16, I32, I64 and U8); convert the "
                  "tensor before saving it");
    t.type = *type;
    if (!shape->is_array()) throw fail("expected the shape of " + what + " to be an array");
    std::uint64_t n = 1;
    for (auto const& d : shape->items) {
      std::uint64_t dim = 0;
      if (!d.as_u64(dim))
        throw fail("expected the shape of " + what + " to hold non-negative integers, found '" + d.text + "'");
      if (!checked_mul(n, dim, n)) throw fail("the shape of " + what + " has more elements than 2^64");
      t.shape.push_back(dim);
    }
    if (!offsets->is_array() || offsets->items.size() != 2 || !offsets->items[0].as_u64(t.begin) ||
        !offsets->items[1].as_u64(t.end))
      throw fail("expected the data_offsets of " + what + " to be two non-negative integers [begin, end]");
    std::uint64_t bytes = 0;
    if (!checked_mul(n, size_of(t.type), bytes)) throw fail("the shape of " + what + " has more bytes than 2^64");
    if (t.end < t.begin)
      throw fail(what + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                 "], which end before they begin");
    if (t.end > data_size)
      throw fail(what + " has data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                 "] outside the data section of " + std::to_string(data_size) + " bytes (the file is truncated?)");
    if (t.end - t.begin != bytes)
      throw fail(what + " has dtype " + std::string(name_of(t.type)) + " and shape " + shape_string(t.shape) + " (" +
                 std::to_string(bytes) + " bytes) but data_offsets [" + std::to_string(t.begin) + ", " +
                 std::to_string(t.end) + "] (" + std::to_string(t.end - t.begin) + " bytes)");
    out.push_back(std::move(t));
  }
  // The tensors must tile the data section: no overlap, no hole, nothing after the last one.
  std::stable_sort(out.begin(), out.end(), [](tensor_info const& a, tensor_info const& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected = 0;
  std::string const* previous = nullptr;
  for (auto const& t : out) {
    if (t.begin < expected)
      throw fail("tensor " + single_quoted(t.name) + " (bytes " + std::to_string(t.begin) + " to " +
                 std::to_string(t.end) + ") overlaps tensor " +
                 single_quoted(previous != nullptr ? *previous : std::string()));
    if (t.begin > expected)
      throw fail("bytes " + std::to_string(expected) + " to " + std::to_string(t.begin) +
                 " of the data section belong to no tensor");
    expected = t.end;
    previous = &t.name;
  }
  if (expected != data_size)
    throw fail("the data section has " + std::to_string(data_size) + " bytes but its tensors cover " +
               std::to_string(expected));
  return out;
}

}  // namespace detail

/// Writes `tensors` (host memory) and `metadata` to `path` in the safetensors format, atomically.
/// Throws invalid_argument for a bad tensor list (duplicate or reserved names, a shape that does
/// not match the element count, device memory) and dparallel::error when the file cannot be
/// written; then the previous file, if any, is unchanged.
inline void save_safetensors(std::filesystem::path const& path, std::span<named_tensor const> tensors,
                             safetensors_metadata const& metadata = {}) {
  detail::require_little_endian();
  std::string const where = "'" + path.string() + "'";
  std::string const header = detail::make_safetensors_header(tensors, metadata, where);
  detail::write_file_atomically(path, [&](detail::file_sink& out) {
    unsigned char len[8];
    auto n = static_cast<std::uint64_t>(header.size());
    for (auto& b : len) {
      b = static_cast<unsigned char>(n & 0xFF);
      n >>= 8;
    }
    out.write(len, sizeof len);
    out.write(header.data(), header.size());
    for (auto const& t : tensors) out.write(t.data.data(), t.data.size_bytes());
  });
}
inline void save_safetensors(std::filesystem::path const& path, std::initializer_list<named_tensor> tensors,
                             safetensors_metadata const& metadata = {}) {
  save_safetensors(path, std::span<named_tensor const>(tensors.begin(), tensors.size()), metadata);
}

/// An open safetensors file whose header has been read and validated. Tensor data is read on
/// demand, straight into the caller's memory. Movable, not copyable; not for concurrent use.
class safetensors_reader {
 public:
  /// Opens `path` and validates its header; throws dparallel::error naming the file and the
  /// fault when it cannot be read or is not a valid safetensors file.
  explicit safetensors_reader(std::filesystem::path path) : path_(std::move(path)) {
    detail::require_little_endian();
    std::string const where = "'" + path_.string() + "'";
    std::error_code ec;
    std::uint64_t const size = std::filesystem::file_size(path_, ec);
    if (ec) throw error("dparallel: could not open " + where + ": " + ec.message());
    in_.open(path_, std::ios::binary);
    if (!in_) throw error("dparallel: could not open " + where + " for reading");
    auto fail = [&](std::string const& what) {
      return error("dparallel: " + where + ": " + what + "; the file is corrupt or not a safetensors file");
    };
    if (size < 8)
      throw fail("the file has " + std::to_string(size) +
                 " bytes, fewer than the 8-byte header length it must start with");
    unsigned char len[8];
    if (!in_.read(reinterpret_cast<char*>(len), 8)) throw fail("could not read the header length");
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
    if (n > max_safetensors_header)
      throw fail("the header length field says " + std::to_string(n) + " bytes, more than the " +
                 std::to_string(max_safetensors_header) + " a safetensors header may have");
    if (n > size - 8)
      throw fail("the header length field says " + std::to_string(n) + " bytes but only " + std::to_string(size - 8) +
                 " follow it (the file is truncated?)");
    if (n < 2) throw fail("the header has " + std::to_string(n) + " bytes, too few for a JSON object");
    std::string header(static_cast<std::size_t>(n), '\0');
    if (!in_.read(header.data(), static_cast<std::streamsize>(n))) throw fail("could not read the header");
    if (header.front() != '{') throw fail("expected the header to start with '{'");
    data_offset_ = 8 + n;
    tensors_ =
        detail::check_safetensors_header(detail::json::parse(header, where), size - data_offset_, metadata_, where);
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  /// The file this reader reads.
  [[nodiscard]] std::filesystem::path const& path() const noexcept { return path_; }
  /// The tensors, in the order of their data in the file.
  [[nodiscard]] std::vector<tensor_info> const& tensors() const noexcept { return tensors_; }
  /// The tensor named `name`, or nullptr.
  [[nodiscard]] tensor_info const* find(std::string_view name) const {
    auto const it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  /// The file's __metadata__ (string to string).
  [[nodiscard]] safetensors_metadata const& metadata() const noexcept { return metadata_; }
  /// Where the data section starts in the file (8 + header length).
  [[nodiscard]] std::uint64_t data_offset() const noexcept { return data_offset_; }

  /// Reads tensor `t` into `dst`, which must be host memory of the same dtype and element count.
  void read(tensor_info const& t, tensor_ref dst) const {
    std::string const where = "'" + path_.string() + "'";
    detail::require(dst.device().kind == device_kind::host,
                    "read " + where + ": the destination of tensor '" + t.name + "' is in " + to_string(dst.device()) +
                        " memory; read into host memory and copy it to the device");
    detail::require(dst.dtype() == t.type && dst.size() == t.elements(),
                    "read " + where + ": tensor '" + t.name + "' holds " + std::to_string(t.elements()) +
                        " elements of " + std::string(name_of(t.type)) + ", the destination " +
                        std::to_string(dst.size()) + " elements of " + std::string(name_of(dst.dtype())));
    read_bytes(t, dst.data());
  }

  /// The tensor named `name` as a std::vector<T>; throws when it is absent or not of dtype T.
  template <element T>
  [[nodiscard]] std::vector<T> read_vector(std::string_view name) const {
    tensor_info const* t = find(name);
    detail::require(t != nullptr, "read '" + path_.string() + "': expected a tensor named '" + std::string(name) +
                                      "', found none");
    std::vector<T> out(static_cast<std::size_t>(t->elements()));
    read(*t, tensor_ref(tensor_view<T>(out.data(), out.size())));
    return out;
  }

 private:
  void read_bytes(tensor_info const& t, void* dst) const {
    if (t.size_bytes() == 0) return;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(data_offset_ + t.begin));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(t.size_bytes()));
    if (!in_ || static_cast<std::uint64_t>(in_.gcount()) != t.size_bytes())
      throw error("dparallel: '" + path_.string() + "': could not read the " + std::to_string(t.size_bytes()) +
                  " bytes of tensor '" + t.name + "' (the file changed or was truncated while it was read)");
  }

  std::filesystem::path path_;
  mutable std::ifstream in_;
  std::vector<tensor_info> tensors_;
  std::unordered_map<std::string_view, std::size_t> index_;  // views of the names in tensors_
  safetensors_metadata metadata_;
  std::uint64_t data_offset_ = 0;
};

DPARALLEL_NAMESPACE_END
