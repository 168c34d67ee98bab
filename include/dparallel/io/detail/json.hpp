#pragma once
// A minimal JSON reader and writer for exactly what a safetensors header needs: objects, arrays,
// strings, numbers, true/false/null. The reader is strict (RFC 8259 grammar, valid UTF-8, no
// duplicate keys, bounded nesting depth) and reports every problem as a dparallel::error that
// names the byte offset, so a corrupt or hostile header never causes undefined behaviour.
//
//   auto v = dparallel::detail::json::parse(text, "model.safetensors");  // throws dparallel::error
//   std::string out;
//   dparallel::detail::json::write_string(out, "fc1.weight");            // "\"fc1.weight\""

#include <dparallel/config.hpp>
#include <dparallel/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

DPARALLEL_NAMESPACE_BEGIN

namespace detail::json {

/// Deepest nesting the reader accepts; a safetensors header needs 3 levels.
inline constexpr int max_depth = 64;

struct member;

/// A parsed JSON value. Numbers keep their text: the safetensors reader needs exact unsigned
/// integers, which it extracts with value::as_u64.
struct value {
  enum class kind : std::uint8_t { null, boolean, number, string, array, object };
  kind type = kind::null;
  bool boolean = false;
  std::string text;  ///< the string (decoded) or the number (as written)
  std::vector<value> items;                                  ///< array elements
  std::vector<member> members;                               ///< object members, in file order
  std::size_t offset = 0;                                    ///< where the value starts (for messages)

  [[nodiscard]] bool is_object() const noexcept { return type == kind::object; }
  [[nodiscard]] bool is_array() const noexcept { return type == kind::array; }
  [[nodiscard]] bool is_string() const noexcept { return type == kind::string; }
  [[nodiscard]] bool is_number() const noexcept { return type == kind::number; }

  /// The member named `key` of an object, or nullptr.
  [[nodiscard]] value const* find(std::string_view key) const noexcept;

  /// The number as an unsigned 64-bit integer; false when it is not written as a non-negative
  /// integer (no sign, fraction or exponent) or does not fit.
  [[nodiscard]] bool as_u64(std::uint64_t& out) const noexcept {
    if (type != kind::number || text.empty()) return false;
    std::uint64_t r = 0;
    for (char c : text) {
      if (c < '0' || c > '9') return false;
      auto const d = static_cast<std::uint64_t>(c - '0');
      if (r > (std::numeric_limits<std::uint64_t>::max() - d) / 10) return false;
      r = r * 10 + d;
    }
    out = r;
    return true;
  }
};

/// An object member. (Not std::pair<std::string, value>: instantiating that pair needs `value`
/// complete, whose destructor needs the pair complete; clang with libstdc++ rejects the cycle.)
struct member {
  std::string key;
  value val;
};

inline value const* value::find(std::string_view key) const noexcept {
  for (auto const& [k, v] : members)
    if (k == key) return &v;
  return nullptr;
}

/// Name of a kind, for messages.
inline char const* kind_name(value::kind k) noexcept {
  switch (k) {
    case value::kind::null: return "null";
    case value::kind::boolean: return "a boolean";
    case value::kind::number: return "a number";
    case value::kind::string: return "a string";
    case value::kind::array: return "an array";
    case value::kind::object: return "an object";
  }
  return "?";
}

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
  std::uint32_t const min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

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
  out += '"';
  for (char ch : s) {
    auto const c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

/// The reader: a recursive-descent parser over the header bytes.
class parser {
 public:
  parser(std::string_view text, std::string where) : s_(text), where_(std::move(where)) {}

  /// Parses one value followed only by whitespace.
  value parse_document() {
    if (!valid_utf8(s_)) fail(0, "the header is not valid UTF-8");
    value v = parse_value(0);
    skip_ws();
    if (i_ != s_.size()) fail(i_, "unexpected text after the end of the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(std::size_t at, std::string const& what) const {
    throw error("dparallel: " + where_ + ": invalid JSON in the safetensors header at byte " + std::to_string(at) +
                ": " + what + "; the file is corrupt or not a safetensors file");
  }

  void skip_ws() noexcept {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }

  [[nodiscard]] char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }

  void expect(char c) {
    if (i_ >= s_.size()) fail(i_, std::string("expected '") + c + "', found the end of the header");
    if (s_[i_] != c) fail(i_, std::string("expected '") + c + "', found " + describe(s_[i_]));
    ++i_;
  }

  static std::string describe(char c) {
    auto const u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string("'") + c + "'";
    return "byte 0x" + std::string{"0123456789abcdef"[u >> 4], "0123456789abcdef"[u & 0xF]};
  }

  value parse_value(int depth) {
    if (depth > max_depth) fail(i_, "nesting deeper than " + std::to_string(max_depth) + " levels");
    skip_ws();
    if (i_ >= s_.size()) fail(i_, "expected a value, found the end of the header");
    value v;
    v.offset = i_;
    char const c = s_[i_];
    if (c == '{') {
      v.type = value::kind::object;
      ++i_;
      skip_ws();
      if (peek() == '}') {
        ++i_;
        return v;
      }
      std::unordered_set<std::string> keys;
      for (;;) {
        skip_ws();
        if (peek() != '"') fail(i_, "expected a string key");
        std::size_t const key_at = i_;
        std::string key = parse_string();
        if (!keys.insert(key).second) fail(key_at, "duplicate key \"" + key + "\"");
        skip_ws();
        expect(':');
        value member = parse_value(depth + 1);
        v.members.push_back({std::move(key), std::move(member)});
        skip_ws();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.type = value::kind::array;
      ++i_;
      skip_ws();
      if (peek() == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.items.push_back(parse_value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.type = value::kind::string;
      v.text = parse_string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = value::kind::number;
      v.text = parse_number();
      return v;
    }
    if (literal("true")) {
      v.type = value::kind::boolean;
      v.boolean = true;
      return v;
    }
    if (literal("false")) {
      v.type = value::kind::boolean;
      return v;
    }
    if (literal("null")) return v;
    fail(i_, "expected a value, found " + describe(c));
  }

  bool literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) return false;
    i_ += word.size();
    return true;
  }

  std::string parse_number() {
    std::size_t const start = i_;
    auto digit = [&] { return i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9'; };
    if (peek() == '-') ++i_;
    if (!digit()) fail(i_, "expected a digit in a number");
    if (s_[i_] == '0') {
      ++i_;
    } else {
      while (digit()) ++i_;
    }
    if (peek() == '.') {
      ++i_;
      if (!digit()) fail(i_, "expected a digit after the decimal point");
      while (digit()) ++i_;
    }
    if (peek() == 'e' || peek() == 'E') {
      ++i_;
      if (peek() == '+' || peek() == '-') ++i_;
      if (!digit()) fail(i_, "expected a digit in the exponent");
      while (digit()) ++i_;
    }
    return std::string(s_.substr(start, i_ - start));
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
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
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
        out += c;
        ++i_;
        continue;
      }
      ++i_;
      if (i_ >= s_.size()) fail(i_, "unterminated escape");
      char const e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
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
          append_utf8(out, cp);
          break;
        }
        default: fail(i_ - 1, "invalid escape \\" + std::string(1, e));
      }
    }
  }

  std::string_view s_;
  std::string where_;
  std::size_t i_ = 0;
};

/// Parses `text` as one JSON document; `where` (a file name) prefixes error messages.
inline value parse(std::string_view text, std::string where) { return parser(text, std::move(where)).parse_document(); }

}  // namespace detail::json

DPARALLEL_NAMESPACE_END
