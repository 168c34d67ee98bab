#pragma once
// The exception hierarchy. Every error dparallel raises derives from dparallel::error; the message
// says what was expected, what was found, where (device or rank) and, when it helps, what to do.

#include <dparallel/config.hpp>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

DPARALLEL_NAMESPACE_BEGIN

/// Base of every exception thrown by dparallel.
class error : public std::runtime_error {
 public:
  /// An error whose message is `what`.
  explicit error(std::string const& what) : std::runtime_error(what) {}
};

/// A bad argument: an empty device list, a batch of size zero, mismatched sizes, ...
class invalid_argument : public error {
 public:
  /// Constructed from its message, as error.
  using error::error;
};

/// Failure of work that ran on one logical device (the user's step function included).
/// `device()` is the device index; the original exception is kept as the nested exception.
class device_error : public error {
 public:
  /// Work on device index `device` failed with message `what`.
  device_error(int device, std::string const& what)
      : error("dparallel: on device " + std::to_string(device) + ": " + what), device_(device) {}
  /// Index of the device where the work failed.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  int device_;
};

/// Failure seen by a rank of a process group: a peer that threw, died or timed out.
/// `rank()` names the rank at fault (not necessarily the rank that caught it).
class comm_error : public error {
 public:
  /// A failure caused by, or seen from, rank `rank`, with message `what`.
  comm_error(int rank, std::string const& what) : error(what), rank_(rank) {}
  /// The rank the error names.
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

/// A wait that did not complete within its timeout.
class timeout_error : public comm_error {
 public:
  /// Constructed as comm_error: the rank the timeout names, and the message.
  using comm_error::comm_error;
};

namespace detail {
/// Throws invalid_argument with "dparallel: <what>" when `cond` is false.
inline void require(bool cond, std::string const& what) {
  if (!cond) throw invalid_argument("dparallel: " + what);
}
/// The same for a literal message: nothing is built when `cond` holds.
inline void require(bool cond, char const* what) {
  if (!cond) throw invalid_argument(std::string("dparallel: ") + what);
}
/// The same with the message made by `what()` only when `cond` is false: for checks on a path
/// that runs every step or every collective, where building the text each time would cost.
template <class Message>
  requires std::is_invocable_r_v<std::string, Message&>
void require(bool cond, Message&& what) {
  if (!cond) throw invalid_argument("dparallel: " + std::string(what()));
}
}  // namespace detail

DPARALLEL_NAMESPACE_END
