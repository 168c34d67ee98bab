#pragma once
// Text from outside (a file's tensor names and metadata, an environment variable) made safe to
// quote in an error message: control characters, DEL and bytes that are not valid UTF-8 become
// escapes, so a crafted name cannot clear a terminal, ring a bell or forge a line of a log.
//
//   dparallel::detail::printable("fc\x1b[2J\n")   // "fc\\x1b[2J\\n"

#include <dparallel/config.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

DPARALLEL_NAMESPACE_BEGIN

namespace detail {

/// Length of the UTF-8 sequence starting at s[i] (1..4), or 0 when it is not valid UTF-8
/// (overlong forms, surrogates and code points above U+10FFFF are invalid).
inline std::size_t utf8_sequence(std::string_view s, std::size_t i) noexcept {
  auto const b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char const c = b(i);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  std::uint32_t cp = 0;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1Fu;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0Fu;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07u;
  } else {
    return 0;
  }
  if (s.size() - i < n) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3Fu);
  }
  constexpr std::uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

/// `s` with every byte that could act on a terminal or a log escaped: \n, \r, \t, \\ and \xNN for
/// the other control characters, DEL, and bytes that are not part of valid UTF-8. Printable ASCII
/// and valid multi-byte UTF-8 stay as they are. At most `limit` input bytes are shown (then "...").
inline std::string printable(std::string_view s, std::size_t limit = 256) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() < limit ? s.size() : limit);
  for (std::size_t i = 0; i < s.size();) {
    if (i >= limit) {
      out.append("...");
      break;
    }
    auto const c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out.push_back(static_cast<char>(c));
      ++i;
      continue;
    }
    std::size_t const n = c >= 0x80 ? utf8_sequence(s, i) : 0;
    if (n > 1) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    switch (c) {
      case '\\': out.append("\\\\"); break;
      case '\n': out.append("\\n"); break;
      case '\r': out.append("\\r"); break;
      case '\t': out.append("\\t"); break;
      default:
        out.append("\\x");
        out.push_back(hex[c >> 4]);
        out.push_back(hex[c & 0xF]);
    }
    ++i;
  }
  return out;
}

/// printable(s) between single quotes, for messages: 'fc1.weight'.
inline std::string in_quotes(std::string_view s) {
  std::string out(1, '\'');
  out.append(printable(s));
  out.push_back('\'');
  return out;
}

}  // namespace detail

DPARALLEL_NAMESPACE_END
