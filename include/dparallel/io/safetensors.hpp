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
// (little-endian, row-major). The reader also accepts what the reference implementation accepts
// where it is harmless: whitespace before '{', "__metadata__": null, keys it does not know, and
// tensors of safetensors dtypes dparallel does not handle (listed by unsupported(), never read).
// It rejects, with a dparallel::error naming the file and the fault (input quoted with its
// control characters escaped), anything else: a file shorter than its header, a header length
// above max_safetensors_header (100,000,000 bytes), invalid JSON or UTF-8, a dtype that is no
// safetensors dtype, a shape whose size disagrees with the offsets, offsets outside the data
// section, overlapping tensors, bytes of the data section no tensor covers, and names that appear
// twice (see detail/safetensors_header.hpp for why). The header is read in one streaming pass that
// keeps only names, dtypes, shapes, offsets and metadata, so its memory is a small multiple of its
// size, and running out of memory is a dparallel::error too.
//
// Writes are atomic (see detail::write_file_atomically): a failed save leaves the previous file.

#include <dparallel/config.hpp>
#include <dparallel/core/device.hpp>
#include <dparallel/core/dtype.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/tensor_view.hpp>
#include <dparallel/io/detail/atomic_file.hpp>
#include <dparallel/io/detail/file_watch.hpp>
#include <dparallel/io/detail/json.hpp>
#include <dparallel/core/detail/printable.hpp>
#include <dparallel/io/detail/safetensors_header.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

inline void require_little_endian() {
  if constexpr (std::endian::native != std::endian::little)
    throw error("dparallel: safetensors files are little-endian and this machine is not; converting the byte "
                "order is not implemented");
}

/// FNV-1a over `n` bytes, continuing from `h`: a fingerprint of a header, to notice a file
/// rewritten in place while it is read.
inline std::uint64_t fnv1a(void const* data, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ull) noexcept {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

}  // namespace detail

/// Writes `tensors` (host memory) and `metadata` to `path` in the safetensors format, atomically.
/// Throws invalid_argument for a bad tensor list (duplicate or reserved names, a shape that does
/// not match the element count, device memory) and dparallel::error when the file cannot be
/// written; then the previous file, if any, is unchanged.
inline void save_safetensors(std::filesystem::path const& path, std::span<named_tensor const> tensors,
                             safetensors_metadata const& metadata = {}) {
  detail::require_little_endian();
  std::string const where = detail::in_quotes(path.string());
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
  /// fault when it cannot be read or is not a valid safetensors file (running out of memory for
  /// the header included).
  explicit safetensors_reader(std::filesystem::path path) : path_(std::move(path)) {
    detail::require_little_endian();
    std::string const where = detail::in_quotes(path_.string());
    std::error_code ec;
    std::uint64_t const size = std::filesystem::file_size(path_, ec);
    if (ec) throw error("dparallel: could not open " + where + ": " + ec.message());
    // The watch and the stream must be the same file: a rename over `path` between the two opens
    // (a writer replacing it) is retried.
    for (int tries = 0; tries < 3; ++tries) {
      watch_ = detail::file_watch(path_);
      in_.close();
      in_.clear();
      in_.open(path_, std::ios::binary);
      if (!in_) throw error("dparallel: could not open " + where + " for reading");
      if (watch_.names(path_)) break;
    }
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
    data_offset_ = 8 + n;
    size_ = size;
    try {
      std::string header(static_cast<std::size_t>(n), '\0');
      if (!in_.read(header.data(), static_cast<std::streamsize>(n))) throw fail("could not read the header");
      fingerprint_ = detail::fnv1a(header.data(), header.size(), detail::fnv1a(len, sizeof len));
      auto parsed = detail::parse_safetensors_header(header, size - data_offset_, where);
      tensors_ = std::move(parsed.tensors);
      unsupported_ = std::move(parsed.unsupported);
      metadata_ = std::move(parsed.metadata);
      for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
    } catch (std::bad_alloc const&) {
      throw error("dparallel: " + where + ": not enough memory to read its header of " + std::to_string(n) +
                  " bytes (reading it takes a few times its size); free memory or raise the process's limit");
    }
  }

  /// The file this reader reads.
  [[nodiscard]] std::filesystem::path const& path() const noexcept { return path_; }
  /// The tensors dparallel can read, in the order of their data in the file.
  [[nodiscard]] std::vector<tensor_info> const& tensors() const noexcept { return tensors_; }
  /// The file's tensors of dtypes dparallel does not handle (BOOL, I8, U16, F8_E4M3, ...), in file
  /// order: validated, never read. A non-strict load skips them (load_result::skipped).
  [[nodiscard]] std::vector<unsupported_tensor> const& unsupported() const noexcept { return unsupported_; }
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
    std::string const where = detail::in_quotes(path_.string());
    detail::require(dst.device().kind == device_kind::host, [&] {
      return "read " + where + ": the destination of tensor " + detail::in_quotes(t.name) + " is in " +
             to_string(dst.device()) + " memory; read into host memory and copy it to the device";
    });
    detail::require(dst.dtype() == t.type && dst.size() == t.elements(), [&] {
      return "read " + where + ": tensor " + detail::in_quotes(t.name) + " holds " + std::to_string(t.elements()) +
             " elements of " + std::string(name_of(t.type)) + ", the destination " + std::to_string(dst.size()) +
             " elements of " + std::string(name_of(dst.dtype()));
    });
    read_bytes(t, dst.data());
  }

  /// Reads tensor `t`'s bytes into `dst` (t.size_bytes() bytes of host memory).
  void read_bytes(tensor_info const& t, void* dst) const {
    if (t.size_bytes() == 0) return;
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(data_offset_ + t.begin));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(t.size_bytes()));
    if (!in_ || static_cast<std::uint64_t>(in_.gcount()) != t.size_bytes())
      throw error("dparallel: " + detail::in_quotes(path_.string()) + ": could not read the " +
                  std::to_string(t.size_bytes()) + " bytes of tensor " + detail::in_quotes(t.name) +
                  " (the file changed or was truncated while it was read)");
  }

  /// Throws dparallel::error when the open file was written since it was opened: its size,
  /// header, or modification and change times differ (it was truncated or rewritten in place; see
  /// io/detail/file_watch.hpp for the times' granularity). A file replaced by a rename, as
  /// dparallel's own saves do, is not this one: the reader keeps reading the file it opened.
  void verify_unchanged() const {
    auto changed = [&](std::string const& what) {
      return error("dparallel: " + detail::in_quotes(path_.string()) + " changed while it was read (" + what +
                   "); nothing was loaded: load it again once the writer is done");
    };
    if (auto const what = watch_.changes(); !what.empty()) throw changed(what);
    in_.clear();
    in_.seekg(0, std::ios::end);
    auto const now = static_cast<std::uint64_t>(in_.tellg());
    if (!in_ || now != size_)
      throw changed("it had " + std::to_string(size_) + " bytes, now " + std::to_string(now));
    in_.seekg(0);
    std::uint64_t h = 0xcbf29ce484222325ull;
    char buf[1 << 14];
    for (std::uint64_t left = data_offset_; left > 0;) {
      auto const k = static_cast<std::size_t>(std::min<std::uint64_t>(left, sizeof buf));
      if (!in_.read(buf, static_cast<std::streamsize>(k))) throw changed("its header could not be read again");
      h = detail::fnv1a(buf, k, h);
      left -= k;
    }
    if (h != fingerprint_) throw changed("its header is not the one read when it was opened");
  }

  /// The tensor named `name` as a std::vector<T>; throws when it is absent or not of dtype T.
  template <element T>
  [[nodiscard]] std::vector<T> read_vector(std::string_view name) const {
    tensor_info const* t = find(name);
    detail::require(t != nullptr, [&] {
      return "read " + detail::in_quotes(path_.string()) + ": expected a tensor named " + detail::in_quotes(name) +
             ", found none";
    });
    std::vector<T> out(static_cast<std::size_t>(t->elements()));
    read(*t, tensor_ref(tensor_view<T>(out.data(), out.size())));
    return out;
  }

 private:
  std::filesystem::path path_;
  mutable std::ifstream in_;
  detail::file_watch watch_;  // the same file, for fstat
  std::vector<tensor_info> tensors_;
  std::vector<unsupported_tensor> unsupported_;
  std::unordered_map<std::string_view, std::size_t> index_;  // views of the names in tensors_
  safetensors_metadata metadata_;
  std::uint64_t data_offset_ = 0;
  std::uint64_t size_ = 0;
  std::uint64_t fingerprint_ = 0;  // of the length field and the header
};

DPARALLEL_NAMESPACE_END
