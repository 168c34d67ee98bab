#pragma once
// Fashion-MNIST as the Debian package dataset-fashion-mnist installs it: four gzip'ed IDX files,
// read with zlib. Images become rows of 784 floats in [0, 1], labels int32 classes 0..9.
//
// IDX format: a big-endian header (magic 0x00000803 for 3-dimensional unsigned-byte data,
// 0x00000801 for 1-dimensional; then one 32-bit size per dimension), then the bytes, row-major.

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fashion_mnist {

inline constexpr std::size_t image_side = 28;
inline constexpr std::size_t image_size = image_side * image_side;  // 784 pixels
inline constexpr std::size_t classes = 10;
/// Where the Debian package puts the files.
inline constexpr char const* default_dir = "/usr/share/datasets/fashion-mnist";

/// One split: `images` holds size() rows of image_size pixels, `labels` one class per image.
struct dataset {
  std::vector<float> images;
  std::vector<std::int32_t> labels;
  [[nodiscard]] std::size_t size() const noexcept { return labels.size(); }
};

namespace detail {

struct gz_closer {
  void operator()(gzFile_s* f) const noexcept { gzclose(f); }
};
using gz_file = std::unique_ptr<gzFile_s, gz_closer>;

inline std::string hex32(std::uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", static_cast<unsigned>(v));
  return s;
}

/// A gzip'ed (or plain: zlib reads those transparently) IDX file being read front to back.
class idx_reader {
 public:
  explicit idx_reader(std::string path) : path_(std::move(path)) {
    errno = 0;
    file_.reset(gzopen(path_.c_str(), "rb"));
    if (!file_) {
      throw std::runtime_error("cannot open " + path_ + ": " + (errno != 0 ? std::strerror(errno) : "out of memory") +
                               "; install the Debian package dataset-fashion-mnist or pass --data DIR naming the "
                               "folder that holds the four *-ubyte.gz files");
    }
    gzbuffer(file_.get(), 1u << 20);
  }

  [[nodiscard]] std::string const& path() const noexcept { return path_; }

  /// Reads `n` bytes or throws, saying what was being read.
  void read(void* dst, std::size_t n, char const* what) {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t done = 0;
    while (done < n) {
      std::size_t const chunk = std::min<std::size_t>(n - done, std::size_t{1} << 30);
      int const got = gzread(file_.get(), out + done, static_cast<unsigned>(chunk));
      if (got < 0) {
        int code = 0;
        char const* msg = gzerror(file_.get(), &code);
        throw std::runtime_error(path_ + ": read error while reading " + what + ": " + msg +
                                 "; the file is damaged, reinstall dataset-fashion-mnist");
      }
      if (got == 0) {
        throw std::runtime_error(path_ + ": the file is truncated: expected " + std::to_string(n) + " bytes of " +
                                 what + ", found only " + std::to_string(done) +
                                 "; the file is damaged, reinstall dataset-fashion-mnist");
      }
      done += static_cast<std::size_t>(got);
    }
  }

  std::uint32_t read_u32(char const* what) {
    std::array<unsigned char, 4> b{};
    read(b.data(), b.size(), what);
    return (std::uint32_t{b[0]} << 24) | (std::uint32_t{b[1]} << 16) | (std::uint32_t{b[2]} << 8) | std::uint32_t{b[3]};
  }

  /// Reads the magic number and the dimension sizes; checks the magic.
  std::vector<std::uint32_t> header(std::uint32_t expected_magic, char const* kind) {
    std::uint32_t const magic = read_u32("the IDX magic number");
    if (magic != expected_magic) {
      throw std::runtime_error(path_ + ": expected the IDX magic number " + hex32(expected_magic) + " (" + kind +
                               "), found " + hex32(magic) + "; is this the right Fashion-MNIST file?");
    }
    std::vector<std::uint32_t> dims(magic & 0xffu);
    for (auto& d : dims) d = read_u32("the IDX dimension sizes");
    return dims;
  }

  /// Throws unless the file ends here.
  void expect_end(std::string const& after) {
    unsigned char extra = 0;
    int const got = gzread(file_.get(), &extra, 1);
    if (got != 0) {
      throw std::runtime_error(path_ + ": expected the file to end after " + after +
                               ", found more data; the header and the contents disagree");
    }
  }

 private:
  std::string path_;
  gz_file file_;
};

}  // namespace detail

/// Loads one split: `prefix` is "train" or "t10k". Checks magic numbers, the 28x28 image size,
/// that images and labels agree in number, that every label is a class 0..9, and that each file
/// holds exactly what its header announces. With `max_samples` below the split's size, only the
/// first max_samples images and labels are read (and the files' ends are not checked).
inline dataset load(std::string const& dir, std::string const& prefix,
                    std::size_t max_samples = static_cast<std::size_t>(-1)) {
  detail::idx_reader images(dir + "/" + prefix + "-images-idx3-ubyte.gz");
  auto const idims = images.header(0x00000803u, "unsigned bytes, 3 dimensions: images");
  if (idims[1] != image_side || idims[2] != image_side) {
    throw std::runtime_error(images.path() + ": expected images of 28 x 28 pixels, found " + std::to_string(idims[1]) +
                             " x " + std::to_string(idims[2]));
  }
  std::size_t const n = idims[0];
  if (n == 0) throw std::runtime_error(images.path() + ": expected at least one image, found none");

  detail::idx_reader labels(dir + "/" + prefix + "-labels-idx1-ubyte.gz");
  auto const ldims = labels.header(0x00000801u, "unsigned bytes, 1 dimension: labels");
  if (ldims[0] != n) {
    throw std::runtime_error(labels.path() + ": expected one label per image, " + std::to_string(n) + " as in " +
                             images.path() + ", found " + std::to_string(ldims[0]));
  }

  std::size_t const count = std::min(n, max_samples);  // the samples to read
  dataset out;
  std::vector<unsigned char> bytes(count * image_size);
  images.read(bytes.data(), bytes.size(), "pixels");
  if (count == n) images.expect_end(std::to_string(n) + " images");
  out.images.resize(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) out.images[i] = static_cast<float>(bytes[i]) / 255.0f;

  bytes.resize(count);
  labels.read(bytes.data(), count, "labels");
  if (count == n) labels.expect_end(std::to_string(n) + " labels");
  out.labels.resize(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (bytes[i] >= classes) {
      throw std::runtime_error(labels.path() + ": expected labels 0..9, found " + std::to_string(bytes[i]) +
                               " for sample " + std::to_string(i));
    }
    out.labels[i] = bytes[i];
  }
  return out;
}

}  // namespace fashion_mnist
