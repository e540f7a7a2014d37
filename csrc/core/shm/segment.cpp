#include "segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
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

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::release() noexcept {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
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
  // ftruncate only sets the size: on a tmpfs that is too small the first
  // touch of a missing page kills the process with SIGBUS, long after this
  // call. Reserving every page now turns that into an error here.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    struct statvfs vfs{};
    const bool known = fstatvfs(fd, &vfs) == 0;
    close(fd);
    shm_unlink(name.c_str());
    if (err == ENOSPC || err == EFBIG) {
      const unsigned long long free_bytes =
          known ? static_cast<unsigned long long>(vfs.f_bavail) * vfs.f_frsize : 0;
      throw NoSpaceError(
          "dsp: shared memory (/dev/shm) is too small for this process group: its "
          "segment needs " +
          std::to_string(bytes) + " bytes but only " +
          (known ? std::to_string(free_bytes) : std::string("an unknown number of")) +
          " bytes are free. Fix: give /dev/shm more room (docker run --shm-size=1g, "
          "or a Kubernetes emptyDir with medium: Memory), or shrink the segment "
          "with smaller DSP_CHUNK_BYTES / DSP_P2P_RING_BYTES (the same on every "
          "rank).");
    }
    errno = err;
    throw sysError("posix_fallocate", name);
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
      struct stat st{};
      if (fstat(fd, &st) != 0) {
        const int err = errno;
        close(fd);
        errno = err;
        throw sysError("fstat", name);
      }
      // Only a segment that our own user made private is ours: anything else
      // under this name is someone else's, and mapping it would hand them
      // (or us) the other's data.
      if (st.st_uid != geteuid() || (st.st_mode & 0777) != kSegmentMode) {
        close(fd);
        char mode[8];
        std::snprintf(mode, sizeof(mode), "%03o",
                      static_cast<unsigned>(st.st_mode & 0777));
        throw std::runtime_error("dsp: shared-memory segment " + name +
                                 " is owned by uid " + std::to_string(st.st_uid) +
                                 " with mode " + mode + ", not by this process's uid " +
                                 std::to_string(geteuid()) +
                                 " with mode 600: refusing it");
      }
      if (static_cast<size_t>(st.st_size) >= bytes) {
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
