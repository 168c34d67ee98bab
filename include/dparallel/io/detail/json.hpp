#pragma once
// A minimal streaming JSON reader and a string writer, for exactly what a safetensors header
// needs. The reader is a cursor over the header bytes: the caller walks the document it expects
// (objects, keys, strings, unsigned integers) and skips everything else with skip_value, which
// checks the grammar without building anything. So reading a header costs memory only for what
// is kept (names, dtypes, shapes, offsets), never a tree of every value.
//
// The grammar is RFC 8259's, strictly: valid UTF-8, no control characters in strings, valid
// escapes and surrogate pairs, nesting at most max_depth levels. Every problem is a
// dparallel::error that names the byte offset; quoted input is escaped (detail::printable).
//
//   dparallel::detail::json::cursor in(text, "'model.safetensors'");
//   in.expect('{');
//   for (bool first = true; in.more('}', first);) {
//     std::string key = in.key();     // reads "name" and the ':' after it
//     in.skip_value(1);               // or read it: in.string(), in.u64(...), ...
//   }
//   std::string out;
//   dparallel::detail::json::write_string(out, "fc1.weight");            // "\"fc1.weight\""

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>
#include <dparallel/core/detail/printable.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN

namespace detail::json {

/// Most arrays and objects one inside another the reader accepts, the document's own included:
/// 127, as the reference safetensors reader (serde_json, whose recursion limit of 128 refuses
/// the 128th), so that every header it reads is read here too. A safetensors header needs 2.
inline constexpr int max_depth = 127;

using detail::utf8_sequence;

/// Whether `s` is valid UTF-8 (JSON text must be).
inline bool valid_utf8(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    std::size_t const n = utf8_sequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

/// Appends `s` as a JSON string literal (quotes, escapes). `s` must be valid UTF-8.
inline void write_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out.push_back('"');
  for (char ch : s) {
    auto const c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out.append("\\\""); break;
      case '\\': out.append("\\\\"); break;
      case '\n': out.append("\\n"); break;
      case '\r': out.append("\\r"); break;
      case '\t': out.append("\\t"); break;
      case '\b': out.append("\\b"); break;
      case '\f': out.append("\\f"); break;
      default:
        if (c < 0x20) {
          out.append("\\u00");
          out.push_back(hex[c >> 4]);
          out.push_back(hex[c & 0xF]);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('"');
}

/// A cursor over one JSON document (see the top of the file).
class cursor {
 public:
  /// `where` (the file, already quoted) prefixes error messages. Checks that `text` is UTF-8.
  cursor(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {
    if (!valid_utf8(s_)) fail(0, "the header is not valid UTF-8");
  }

  /// Throws the error for a fault at byte `at`.
  [[noreturn]] void fail(std::size_t at, std::string const& what) const {
    throw error("dparallel: " + where_ + ": invalid JSON in the safetensors header at byte " + std::to_string(at) +
                ": " + what + "; the file is corrupt or not a safetensors file");
  }

  /// Where the cursor is (a byte offset, for messages).
  [[nodiscard]] std::size_t offset() const noexcept { return i_; }

  void skip_ws() noexcept {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  /// The next byte after whitespace ('\0' at the end).
  [[nodiscard]] char peek() noexcept {
    skip_ws();
    return i_ < s_.size() ? s_[i_] : '\0';
  }

  /// Whether only whitespace is left.
  [[nodiscard]] bool at_end() noexcept {
    skip_ws();
    return i_ == s_.size();
  }

  /// Consumes `c` (after whitespace) or fails.
  void expect(char c) {
    skip_ws();
    if (i_ >= s_.size()) fail(i_, std::string("expected '") + c + "', found the end of the header");
    if (s_[i_] != c) fail(i_, std::string("expected '") + c + "', found " + describe(s_[i_]));
    ++i_;
  }

  /// Drives a loop over the members of an object or the items of an array whose opening bracket
  /// was consumed: true when another member follows (its separator consumed), false at `close`.
  bool more(char close, bool& first) {
    char const c = peek();
    if (first) {
      first = false;
      if (c == close) {
        ++i_;
        return false;
      }
      return true;
    }
    if (c == ',') {
      ++i_;
      return true;
    }
    expect(close);
    return false;
  }

  /// Reads an object key and the ':' after it.
  std::string key() {
    if (peek() != '"') fail(i_, "expected a string key, found " + found());
    std::string k = string();
    expect(':');
    return k;
  }

  /// What the value at the cursor is, for messages: "an object", "a number '-2'", ...
  [[nodiscard]] std::string found() {
    char const c = peek();
    switch (c) {
      case '\0': return "the end of the header";
      case '{': return "an object";
      case '[': return "an array";
      case '"': return "a string";
      case 't':
      case 'f': return "a boolean";
      case 'n': return "null";
      default: break;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      std::size_t const save = i_;
      std::string_view const text = number_text();
      i_ = save;
      return "'" + std::string(text) + "'";
    }
    return describe(c);
  }

  /// Reads a string value (decoded).
  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail(i_, "unterminated string");
      char const c = s_[i_];
      if (c == '"') {
        ++i_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail(i_, "control character " + describe(c) + " inside a string");
      if (c != '\\') {
        // Copy the run of plain bytes at once.
        std::size_t j = i_ + 1;
        while (j < s_.size() && s_[j] != '"' && s_[j] != '\\' && static_cast<unsigned char>(s_[j]) >= 0x20) ++j;
        out.append(s_.substr(i_, j - i_));
        i_ = j;
        continue;
      }
      escape(&out);
    }
  }

  /// Reads a number; true with `out` set when it is written as a non-negative integer (no sign,
  /// fraction or exponent) that fits 64 bits. `text` receives the number as written.
  bool u64(std::uint64_t& out, std::string_view& text) {
    skip_ws();
    char const c = i_ < s_.size() ? s_[i_] : '\0';
    if (c != '-' && (c < '0' || c > '9')) fail(i_, "expected a number, found " + found());
    text = number_text();
    std::uint64_t r = 0;
    for (char d : text) {
      if (d < '0' || d > '9') return false;
      auto const v = static_cast<std::uint64_t>(d - '0');
      if (r > (std::numeric_limits<std::uint64_t>::max() - v) / 10) return false;
      r = r * 10 + v;
    }
    out = r;
    return true;
  }

  /// Whether the value at the cursor is `null`; consumes it when it is.
  bool null() {
    if (peek() != 'n') return false;
    if (s_.substr(i_, 4) != "null") fail(i_, "expected a value, found " + describe('n'));
    i_ += 4;
    return true;
  }

  /// Skips one value of any kind, checking its grammar but keeping nothing. `depth` is the
  /// nesting level of the value (the document is level 0).
  void skip_value(int depth) {
    char const c = peek();
    if (c == '{' || c == '[') {
      // An array or object at level `depth` is the (depth + 1)-th container, counting the document.
      if (depth >= max_depth) fail(i_, "nesting deeper than " + std::to_string(max_depth) + " levels");
      ++i_;
      char const close = c == '{' ? '}' : ']';
      for (bool first = true; more(close, first);) {
        if (c == '{') {
          if (peek() != '"') fail(i_, "expected a string key, found " + found());
          skip_string();
          expect(':');
        }
        skip_value(depth + 1);
      }
      return;
    }
    if (c == '"') return skip_string();
    if (c == '-' || (c >= '0' && c <= '9')) {
      (void)number_text();
      return;
    }
    for (std::string_view word : {"true", "false", "null"})
      if (s_.substr(i_, word.size()) == word) {
        i_ += word.size();
        return;
      }
    if (i_ >= s_.size()) fail(i_, "expected a value, found the end of the header");
    fail(i_, "expected a value, found " + describe(c));
  }

  /// A byte for a message: 'x' when printable, else its value.
  static std::string describe(char c) {
    auto const u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string("'") + c + "'";
    return "byte 0x" + std::string{"0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 0xF]};
  }

 private:
  std::string_view number_text() {
    std::size_t const start = i_;
    auto digit = [&] { return i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9'; };
    auto next_is = [&](char c) { return i_ < s_.size() && s_[i_] == c; };
    if (next_is('-')) ++i_;
    if (!digit()) fail(i_, "expected a digit in a number");
    if (s_[i_] == '0') {
      ++i_;
    } else {
      while (digit()) ++i_;
    }
    if (next_is('.')) {
      ++i_;
      if (!digit()) fail(i_, "expected a digit after the decimal point");
      while (digit()) ++i_;
    }
    if (next_is('e') || next_is('E')) {
      ++i_;
      if (next_is('+') || next_is('-')) ++i_;
      if (!digit()) fail(i_, "expected a digit in the exponent");
      while (digit()) ++i_;
    }
    return s_.substr(start, i_ - start);
  }

  void skip_string() {
    expect('"');
    for (;;) {
      if (i_ >= s_.size()) fail(i_, "unterminated string");
      char const c = s_[i_];
      if (c == '"') {
        ++i_;
        return;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail(i_, "control character " + describe(c) + " inside a string");
      if (c == '\\') escape(nullptr);
      else ++i_;
    }
  }

  std::uint32_t hex4() {
    if (s_.size() - i_ < 4) fail(i_, "expected four hex digits after \\u");
    std::uint32_t r = 0;
    for (int k = 0; k < 4; ++k) {
      char const c = s_[i_++];
      r <<= 4;
      if (c >= '0' && c <= '9') r |= static_cast<std::uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') r |= static_cast<std::uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') r |= static_cast<std::uint32_t>(c - 'A' + 10);
      else fail(i_ - 1, "expected a hex digit in a \\u escape, found " + describe(c));
    }
    return r;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // Reads the escape at the cursor (a backslash) and appends what it stands for to *out (when given).
  void escape(std::string* out) {
    ++i_;
    if (i_ >= s_.size()) fail(i_, "unterminated escape");
    char const e = s_[i_++];
    char plain = '\0';
    switch (e) {
      case '"': plain = '"'; break;
      case '\\': plain = '\\'; break;
      case '/': plain = '/'; break;
      case 'b': plain = '\b'; break;
      case 'f': plain = '\f'; break;
      case 'n': plain = '\n'; break;
      case 'r': plain = '\r'; break;
      case 't': plain = '\t'; break;
      case 'u': {
        std::size_t const at = i_ - 2;
        std::uint32_t cp = hex4();
        if (cp >= 0xDC00 && cp <= 0xDFFF) fail(at, "a lone low surrogate in a \\u escape");
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (s_.substr(i_, 2) != "\\u") fail(at, "a high surrogate not followed by a low surrogate");
          i_ += 2;
          std::uint32_t const lo = hex4();
          if (lo < 0xDC00 || lo > 0xDFFF) fail(at, "a high surrogate not followed by a low surrogate");
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        if (out != nullptr) append_utf8(*out, cp);
        return;
      }
      default: fail(i_ - 1, "invalid escape \\" + printable(std::string_view(&e, 1)));
    }
    if (out != nullptr) out->push_back(plain);
  }

  std::string_view s_;
  std::string where_;
  std::size_t i_ = 0;
};

}  // namespace detail::json

DPARALLEL_NAMESPACE_END
