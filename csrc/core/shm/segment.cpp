#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <utility>

namespace dsp {
namespace {

constexpr mode_t kSegmentMode = 0600;
constexpr auto kAttachRetry = std::chrono::milliseconds(1);

std::runtime_error sysError(const std::string& what, const std::string& name) {
  return std::runtime_error("dsp: " + what + " of shared-memory segment " + name +
                            " failed: " + std::strerror(errno));
}

void* mapFd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    errno = err;
    throw sysError("mmap", name);
  }
  close(fd);
  return p;
}

}  // namespace

Segment::Segment(std::string name, void* data, size_t size, bool owner)
    : name_(std::move(name)), data_(data), size_(size), linked_(owner) {}

Segment::Segment(Segment&& other) noexcept { *this = std::move(other); }

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    this->~Segment();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment::~Segment() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
}

void Segment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

std::string Segment::randomName() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t r = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("dsp: getrandom failed: ") +
                               std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  std::string name = "/dsp-";
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    name += hex;
  }
  return name;
}

Segment Segment::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, kSegmentMode);
  if (fd < 0) throw sysError("shm_open(create)", name);
  // fchmod: the umask may have cleared bits, never added any; this makes the
  // mode exactly 0600 whatever the umask.
  if (fchmod(fd, kSegmentMode) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    errno = err;
    throw sysError("ftruncate", name);
  }
  try {
    return Segment(name, mapFd(fd, bytes, name), bytes, /*owner=*/true);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
}

Segment Segment::attach(const std::string& name, size_t bytes,
                        std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd >= 0) {
      struct stat st {};
      if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= bytes) {
        return Segment(name, mapFd(fd, bytes, name), bytes, /*owner=*/false);
      }
      close(fd);  // created but not yet sized: retry
    } else if (errno != ENOENT) {
      throw sysError("shm_open(attach)", name);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("dsp: timed out attaching shared-memory segment " + name +
                               " (its creator, rank 0, never made it)");
    }
    std::this_thread::sleep_for(kAttachRetry);
  }
}

}  // namespace dsp
