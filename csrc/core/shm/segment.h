// A POSIX shared-memory segment: created 0600 under an unguessable name by one
// process, attached by the others, unlinked by its creator as soon as every
// rank has attached (so a crash leaves nothing behind in /dev/shm).
#pragma once

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace dsp {

// Raised by Segment::create when /dev/shm cannot hold the segment.
class NoSpaceError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Segment {
 public:
  // Creates a new segment of `bytes` zero-filled bytes, every page reserved
  // (NoSpaceError when /dev/shm cannot hold it). Fails if the name exists
  // (O_EXCL), so two jobs can never share one by accident.
  static Segment create(const std::string& name, size_t bytes);
  // Attaches to a segment made by `create`, retrying until it appears or the
  // deadline passes. Refuses a segment of another user or another mode.
  static Segment attach(const std::string& name, size_t bytes,
                        std::chrono::steady_clock::time_point deadline);
  // A fresh name: "/dsp-" + 128 random bits from the OS.
  static std::string randomName();

  Segment() = default;
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name; the mapping stays valid. Idempotent.
  void unlink();

  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  Segment(std::string name, void* data, size_t size, bool owner);
  // Unlinks (owner) and unmaps; leaves the object empty.
  void release() noexcept;

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;  // creator only: the name still exists
};

}  // namespace dsp
