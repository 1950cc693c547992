#include "shm.h"

#include "copy_pool.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace tw {

const char* const kInvalidInput = "TW_INVALID_INPUT";
const char* const kResourceExhausted = "TW_RESOURCE_EXHAUSTED";
const char* const kRemoteRejected = "TW_REMOTE_REJECTED";
const char* const kTimedOut = "TW_TIMED_OUT";
const char* const kBackendUnavailable = "TW_BACKEND_UNAVAILABLE";
const char* const kClosed = "TW_CLOSED";
const char* const kAborted = "TW_ABORTED";

Status Status::Errno(const char* c, const std::string& what, const char* call, int e) {
  Status s;
  s.code = c;
  s.err = e;
  s.syscall = call;
  s.message = what + ": " + call + " failed: " + std::strerror(e);
  return s;
}

namespace {

// Every multi-byte header field is read and written through these, at fixed offsets that
// are checked against the mapping size first. memcpy keeps the accesses alignment-safe.
template <typename T>
T Load(const uint8_t* base, size_t offset) {
  T v;
  std::memcpy(&v, base + offset, sizeof(T));
  return v;
}
template <typename T>
void Store(uint8_t* base, size_t offset, T v) {
  std::memcpy(base + offset, &v, sizeof(T));
}
template <typename T>
T* AtomicAt(const uint8_t* base, size_t offset) {
  return reinterpret_cast<T*>(const_cast<uint8_t*>(base) + offset);
}

inline void CpuRelax(uint32_t i) {
  if (i < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  } else {
    sched_yield();
  }
}

bool Aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 7u) == 0; }

bool IdCharsOk(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint8_t c = p[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
              c == ':';
    if (!ok) return false;
  }
  return true;
}

Status BasicChecks(const uint8_t* base, size_t size) {
  if (base == nullptr) return Status::Fail(kInvalidInput, "segment is not mapped");
  if (!Aligned(base)) return Status::Fail(kInvalidInput, "segment mapping is not 8-byte aligned");
  if (size < kHeaderSize) {
    return Status::Fail(kInvalidInput, "segment of " + std::to_string(size) + " bytes is smaller than the " +
                                           std::to_string(kHeaderSize) + "-byte header");
  }
  uint64_t magic = __atomic_load_n(AtomicAt<uint64_t>(base, off::magic), __ATOMIC_ACQUIRE);
  if (magic != kMagic) return Status::Fail(kInvalidInput, "segment header has a bad magic (not a tensorwire segment, or not initialised)");
  return Status::Ok();
}

// Validate the seqlock-protected tensor metadata of a consistent snapshot.
Status CheckTensorMeta(const Meta& m) {
  if (m.dtype == 0 || m.dtype > kMaxDtype) {
    return Status::Fail(kInvalidInput, "segment header: dtype code " + std::to_string(m.dtype) + " is unknown");
  }
  if (m.ndim > kMaxNdim) {
    return Status::Fail(kInvalidInput, "segment header: ndim " + std::to_string(m.ndim) + " exceeds " + std::to_string(kMaxNdim));
  }
  if (m.byte_length > m.capacity) {
    return Status::Fail(kInvalidInput, "segment header: byteLength " + std::to_string(m.byte_length) +
                                           " exceeds the slot capacity " + std::to_string(m.capacity));
  }
  uint64_t elems = 1;
  for (uint32_t i = 0; i < m.ndim; i++) {
    uint64_t d = m.shape[i];
    if (d != 0 && elems > kMaxSegmentBytes / d) {
      return Status::Fail(kInvalidInput, "segment header: shape overflows");
    }
    elems *= d;
  }
  uint64_t item = DtypeSize(m.dtype);
  if (elems > kMaxSegmentBytes / item || elems * item != m.byte_length) {
    return Status::Fail(kInvalidInput, "segment header: shape and dtype do not match byteLength " + std::to_string(m.byte_length));
  }
  return Status::Ok();
}

// Read the seqlock-protected fields (no validation).
void ReadTensorFields(const uint8_t* base, Meta* m) {
  m->byte_length = Load<uint64_t>(base, off::byte_length);
  m->dtype = Load<uint32_t>(base, off::dtype);
  m->ndim = Load<uint32_t>(base, off::ndim);
  for (uint32_t i = 0; i < kMaxNdim; i++) m->shape[i] = Load<uint64_t>(base, off::shape + 8 * i);
}

Status DecodeStatic(const uint8_t* base, size_t size, uint32_t require_kind, const std::string& expect_id, Meta* m) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  m->version = Load<uint32_t>(base, off::version);
  if (m->version != kVersion) {
    return Status::Fail(kInvalidInput, "segment header version " + std::to_string(m->version) + " is not supported");
  }
  m->kind = Load<uint32_t>(base, off::kind);
  if (m->kind < kKindPool || m->kind > kKindTable) {
    return Status::Fail(kInvalidInput, "segment header: kind " + std::to_string(m->kind) + " is unknown");
  }
  if (require_kind != 0 && m->kind != require_kind) {
    return Status::Fail(kInvalidInput, "segment header: kind " + std::to_string(m->kind) + ", expected " +
                                           std::to_string(require_kind));
  }
  m->header_size = Load<uint32_t>(base, off::header_size);
  if (m->header_size != kHeaderSize) {
    return Status::Fail(kInvalidInput, "segment header: headerSize " + std::to_string(m->header_size) + " is not " +
                                           std::to_string(kHeaderSize));
  }
  m->data_offset = Load<uint64_t>(base, off::data_offset);
  m->capacity = Load<uint64_t>(base, off::capacity);
  m->device = Load<int32_t>(base, off::device);
  if (m->device < -1 || m->device > 1023) {
    return Status::Fail(kInvalidInput, "segment header: device " + std::to_string(m->device) + " is out of range");
  }
  if (m->kind == kKindPool) {
    if (m->device == -1) {
      if (m->data_offset != kDataOffset) {
        return Status::Fail(kInvalidInput, "segment header: dataOffset " + std::to_string(m->data_offset) + " is not " +
                                               std::to_string(kDataOffset));
      }
      // The capacity must be exactly what the mapping (sized by fstat) holds after the header.
      if (m->capacity == 0 || m->capacity != size - kDataOffset) {
        return Status::Fail(kInvalidInput, "segment header: capacity " + std::to_string(m->capacity) +
                                               " does not match the segment size " + std::to_string(size));
      }
    } else {
      if (m->data_offset != 0 || size != kHeaderSize) {
        return Status::Fail(kInvalidInput, "segment header: a cuda slot header must have dataOffset 0 and no host data");
      }
      if (m->capacity == 0 || m->capacity > kMaxSegmentBytes) {
        return Status::Fail(kInvalidInput, "segment header: capacity " + std::to_string(m->capacity) + " is out of range");
      }
    }
  } else if (m->data_offset != 0 || m->capacity > kMaxSegmentBytes) {
    return Status::Fail(kInvalidInput, "segment header: dataOffset/capacity invalid for this kind");
  }
  m->owner_pid = Load<uint32_t>(base, off::owner_pid);
  if (m->owner_pid == 0 || m->owner_pid > 0x3fffffffu) {
    return Status::Fail(kInvalidInput, "segment header: owner pid " + std::to_string(m->owner_pid) + " is invalid");
  }
  m->owner_start = Load<uint64_t>(base, off::owner_start);
  m->ipc_offset = Load<uint64_t>(base, off::ipc_offset);
  if (m->ipc_offset > kMaxSegmentBytes) return Status::Fail(kInvalidInput, "segment header: ipc offset is out of range");
  std::memcpy(m->ipc_handle, base + off::ipc_handle, kIpcHandleBytes);
  uint8_t idlen = base[off::id_length];
  if (idlen == 0 || !IdCharsOk(base + off::id, idlen)) {
    return Status::Fail(kInvalidInput, "segment header: id is empty or has invalid characters");
  }
  m->id.assign(reinterpret_cast<const char*>(base + off::id), idlen);
  if (!expect_id.empty() && m->id != expect_id) {
    return Status::Fail(kInvalidInput, "segment header names " + m->id + ", expected " + expect_id);
  }
  m->state = __atomic_load_n(AtomicAt<uint32_t>(base, off::state), __ATOMIC_ACQUIRE);
  m->importers = __atomic_load_n(AtomicAt<uint32_t>(base, off::importers), __ATOMIC_RELAXED);
  return Status::Ok();
}

uint64_t MonotonicNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000ull + static_cast<uint64_t>(t.tv_nsec);
}

// Polls of one unchanged odd generation before a reader decides the writer is stuck or
// died mid-write (the same bound readers always had).
// A generation that stays at the same odd value this long means the writer died mid-write.
constexpr uint64_t kStuckWriterNs = 2000000000ull;
// Overall bound on one read, whatever the writer does.
constexpr uint64_t kReadDeadlineNs = 10000000000ull;

// The seqlock reader protocol, shared by every read of seqlock-protected bytes (invariant
// 11). `body(g1)` does the reads under an even generation g1 and returns what they amount
// to; its result is returned only when the generation is unchanged afterwards, so a read
// that overlapped a write is never reported (its result is dropped and the read retried).
// `max_attempts` bounds the reads that overlapped a write and had to be retried. Waiting
// for an odd (write in progress) generation is bounded per write: the count restarts when
// the generation moves, so a live writer that rewrites the slot back to back (odd most of
// the time) no longer exhausts a reader's budget and fails it with a false "write-locked";
// a writer that died mid-write leaves one odd value and still times out as before.
template <typename Body>
Status SeqReadLoop(const uint8_t* base, uint32_t max_attempts, Body&& body) {
  const uint64_t* gen = AtomicAt<uint64_t>(base, off::generation);
  uint64_t stuck_value = 0;  // even: no odd value seen yet
  uint32_t stuck_polls = 0;
  uint64_t stuck_since = 0;  // when the current odd value was first seen
  uint32_t polls = 0;
  uint64_t deadline = 0;
  for (uint32_t attempt = 0; attempt < max_attempts;) {
    // Acquire: nothing below (metadata and data reads) moves above this load.
    uint64_t g1 = __atomic_load_n(gen, __ATOMIC_ACQUIRE);
    if (g1 & 1u) {
      if (g1 != stuck_value) {
        stuck_value = g1;
        stuck_polls = 0;
        stuck_since = 0;
      }
      ++stuck_polls;
      if ((++polls & 1023u) == 0 || stuck_polls == 1) {
        // Time, not a poll count, decides that a writer died mid-write: on a loaded machine a
        // live writer can be descheduled for far longer than any fixed number of polls.
        uint64_t now = MonotonicNs();
        if (stuck_since == 0) stuck_since = now;
        if (now - stuck_since > kStuckWriterNs) break;
        if (deadline == 0) {
          deadline = now + kReadDeadlineNs;
        } else if (now > deadline) {
          break;
        }
      }
      CpuRelax(stuck_polls);
      continue;
    }
    Status s = body(g1);
    // Acquire fence: the reads above complete before the re-check below.
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint64_t g2 = __atomic_load_n(gen, __ATOMIC_RELAXED);
    if (g1 != g2) {
      attempt++;
      continue;
    }
    return s;  // consistent: whatever the body concluded holds for generation g1
  }
  return Status::Fail(kTimedOut, "segment stayed write-locked (a writer is busy or died mid-write)");
}

// Seqlock read of the tensor metadata plus an optional data copy. `dst` may be null.
Status SeqRead(const uint8_t* base, size_t size, Meta* m, uint8_t* dst, size_t dst_len, uint32_t max_attempts) {
  Meta snap = *m;
  Status s = SeqReadLoop(base, max_attempts, [&](uint64_t g1) -> Status {
    ReadTensorFields(base, &snap);
    // Validate before using any size: a torn or hostile header must not drive the copy.
    Status v = CheckTensorMeta(snap);
    bool copy_ok = v.ok() && dst != nullptr && snap.byte_length <= dst_len && snap.byte_length <= size - kDataOffset;
    if (copy_ok) std::memcpy(dst, base + kDataOffset, snap.byte_length);
    if (!v.ok()) return v;  // consistent and still invalid: the header is bad, not torn
    if (dst != nullptr && !copy_ok) {
      return Status::Fail(kInvalidInput, "destination of " + std::to_string(dst_len) + " bytes is smaller than the tensor (" +
                                             std::to_string(snap.byte_length) + " bytes)");
    }
    snap.generation = g1;
    return Status::Ok();
  });
  if (!s.ok()) return s;
  *m = snap;
  return Status::Ok();
}

}  // namespace

std::string NameProblem(const std::string& name) {
  if (name.size() < 6) return "segment name is too short";
  if (name.size() > kMaxNameLength) return "segment name is longer than " + std::to_string(kMaxNameLength) + " bytes";
  if (name.compare(0, 4, "/tw-") != 0) return "segment name must start with /tw-";
  for (size_t i = 1; i < name.size(); i++) {
    char c = name[i];
    if (c == '/') return "segment name may not contain '/' after the leading one";
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
    if (!ok) return "segment name contains a character outside [A-Za-z0-9._-]";
  }
  if (name.find("..") != std::string::npos) return "segment name may not contain '..'";
  return "";
}

size_t DtypeSize(uint32_t dtype) {
  // 1 uint8, 2 int8, 3 uint16, 4 int16, 5 uint32, 6 int32, 7 float16, 8 bfloat16,
  // 9 float32, 10 float64, 11 int64, 12 uint64, 13 bool
  static const uint8_t sizes[kMaxDtype + 1] = {0, 1, 1, 2, 2, 4, 4, 2, 2, 4, 8, 8, 8, 1};
  return dtype <= kMaxDtype ? sizes[dtype] : 0;
}

namespace {

// Where locators live: the directory glibc's shm_open uses, so names keep their meaning.
constexpr const char* kShmDir = "/dev/shm";
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#endif
#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994
#endif
// Fixed size forever: nobody can truncate (SIGBUS for every mapping), grow, or add a seal
// (F_SEAL_FUTURE_WRITE would make the readers' next mmap fail).
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

std::string LocatorPath(const std::string& name) { return std::string(kShmDir) + name; }

int MemfdCreate(const char* name, unsigned flags) {
  // The raw system call: glibc gained memfd_create() only in 2.27.
  return static_cast<int>(syscall(SYS_memfd_create, name, flags));
}

const char* ExhaustedOr(int e, const char* otherwise) {
  return e == ENOSPC || e == ENOMEM || e == EMFILE || e == ENFILE || e == EFBIG ? kResourceExhausted : otherwise;
}

}  // namespace

Status CreateSegment(const std::string& name, uint64_t size, const InitParams& p, Mapping* out) {
  std::string problem = NameProblem(name);
  if (!problem.empty()) return Status::Fail(kInvalidInput, problem);
  if (size < kHeaderSize || size > kMaxSegmentBytes) {
    return Status::Fail(kInvalidInput, "segment size " + std::to_string(size) + " is out of range");
  }
  if (p.id.empty() || p.id.size() > kMaxIdLength || !IdCharsOk(reinterpret_cast<const uint8_t*>(p.id.data()), p.id.size())) {
    return Status::Fail(kInvalidInput, "segment id is empty, too long or has invalid characters");
  }
  if (p.shape.size() > kMaxNdim) return Status::Fail(kInvalidInput, "too many dimensions");
  // The name first, exclusively: it is the reservation (EEXIST: another live or dead owner).
  const std::string path = LocatorPath(name);
  int lfd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (lfd < 0) {
    int e = errno;
    return Status::Errno(e == EEXIST ? kResourceExhausted : ExhaustedOr(e, kInvalidInput), "create " + name, "open", e);
  }
  int fd = -1;
  void* addr = MAP_FAILED;
  auto fail = [&](const char* code, const char* call, int e) {
    Status s = Status::Errno(code, "create " + name, call, e);
    if (addr != MAP_FAILED) munmap(addr, size);
    if (fd >= 0) close(fd);
    close(lfd);
    unlink(path.c_str());
    return s;
  };
  if (fchmod(lfd, 0600) != 0) return fail(kInvalidInput, "fchmod", errno);
  fd = MemfdCreate(name.c_str() + 1, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    int e = errno;
    return fail(e == ENOSYS || e == EINVAL ? kBackendUnavailable : ExhaustedOr(e, kInvalidInput), "memfd_create", e);
  }
  // memfds are created 0777: private like every segment (invariant 10).
  if (fchmod(fd, 0600) != 0) return fail(kInvalidInput, "fchmod", errno);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    return fail(ExhaustedOr(e, kInvalidInput), "ftruncate", e);
  }
  // Reserve the pages now: a later write to an unreserved page under memory pressure is an
  // error here rather than a fault later.
  int fe = posix_fallocate(fd, 0, static_cast<off_t>(size));
  if (fe != 0 && fe != EOPNOTSUPP && fe != EINVAL) return fail(ExhaustedOr(fe, kInvalidInput), "posix_fallocate", fe);
  if (fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    int e = errno;
    return fail(e == EINVAL ? kBackendUnavailable : kInvalidInput, "fcntl(F_ADD_SEALS)", e);
  }
  // MAP_POPULATE: fault every (already reserved) page into this mapping now, at slot
  // creation, instead of on the first write: a first write into a fresh 4 MiB slot
  // otherwise takes ~1000 page faults (and tmpfs zeroes each page at its first fault).
  // For shared tmpfs mappings the prefaulted PTEs are writable (no write-notify), so
  // later writes take no fault at all. Best effort: a failed populate is not an error.
  addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (addr == MAP_FAILED) {
    int e = errno;
    return fail(e == ENOMEM ? kResourceExhausted : kInvalidInput, "mmap", e);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) return fail(kInvalidInput, "fstat", errno);
  uint8_t* base = static_cast<uint8_t*>(addr);
  std::memset(base, 0, kHeaderSize);
  Store<uint32_t>(base, off::version, kVersion);
  Store<uint32_t>(base, off::kind, p.kind);
  Store<uint32_t>(base, off::header_size, kHeaderSize);
  Store<uint64_t>(base, off::data_offset, p.data_offset);
  Store<uint64_t>(base, off::capacity, p.capacity);
  Store<uint32_t>(base, off::owner_pid, p.owner_pid);
  Store<int32_t>(base, off::device, p.device);
  Store<uint64_t>(base, off::owner_start, p.owner_start);
  Store<uint64_t>(base, off::ipc_offset, p.ipc_offset);
  if (p.has_ipc_handle) std::memcpy(base + off::ipc_handle, p.ipc_handle, kIpcHandleBytes);
  Store<uint64_t>(base, off::byte_length, p.byte_length);
  Store<uint32_t>(base, off::dtype, p.dtype);
  Store<uint32_t>(base, off::ndim, static_cast<uint32_t>(p.shape.size()));
  for (size_t i = 0; i < p.shape.size(); i++) Store<uint64_t>(base, off::shape + 8 * i, p.shape[i]);
  base[off::id_length] = static_cast<uint8_t>(p.id.size());
  std::memcpy(base + off::id, p.id.data(), p.id.size());
  // Publish: a reader that sees the magic (acquire) sees every field above.
  __atomic_store_n(AtomicAt<uint64_t>(base, off::magic), kMagic, __ATOMIC_RELEASE);
  // The locator last: a reader finds the segment only once its header is complete.
  uint8_t loc[kLocatorBytes] = {0};
  Store<uint64_t>(loc, 0, kLocatorMagic);
  Store<uint32_t>(loc, 8, 1);
  Store<uint32_t>(loc, 12, static_cast<uint32_t>(getpid()));
  Store<int32_t>(loc, 16, fd);
  Store<uint32_t>(loc, 20, p.kind);
  Store<uint64_t>(loc, 24, p.owner_start);
  Store<uint64_t>(loc, 32, size);
  Store<uint64_t>(loc, 40, static_cast<uint64_t>(st.st_ino));
  Store<uint64_t>(loc, 48, static_cast<uint64_t>(st.st_dev));
  ssize_t w = pwrite(lfd, loc, kLocatorBytes, 0);
  if (w != static_cast<ssize_t>(kLocatorBytes)) return fail(ExhaustedOr(w < 0 ? errno : ENOSPC, kInvalidInput), "pwrite", w < 0 ? errno : ENOSPC);
  close(lfd);
  out->addr = addr;
  out->size = size;
  out->fd = fd;
  return Status::Ok();
}

Status ReadLocator(const std::string& name, Locator* out) {
  std::string problem = NameProblem(name);
  if (!problem.empty()) return Status::Fail(kInvalidInput, problem);
  int lfd = open(LocatorPath(name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (lfd < 0) return Status::Errno(kInvalidInput, "open " + name, "open", errno);
  struct stat st;
  if (fstat(lfd, &st) != 0) {
    int e = errno;
    close(lfd);
    return Status::Errno(kInvalidInput, "open " + name, "fstat", e);
  }
  auto refuse = [&](const std::string& why) {
    close(lfd);
    return Status::Fail(kInvalidInput, "segment " + name + " " + why);
  };
  if (!S_ISREG(st.st_mode)) return refuse("is not a regular file");
  if (st.st_uid != geteuid()) return refuse("belongs to uid " + std::to_string(st.st_uid) + ", not to this user");
  if ((st.st_mode & 0077) != 0) return refuse("is accessible to other users (mode must be 0600)");
  uint8_t buf[kLocatorBytes];
  ssize_t n = pread(lfd, buf, kLocatorBytes, 0);
  close(lfd);
  if (n != static_cast<ssize_t>(kLocatorBytes) || Load<uint64_t>(buf, 0) != kLocatorMagic || Load<uint32_t>(buf, 8) != 1) {
    return Status::Fail(kInvalidInput, "segment " + name + " has no valid locator (not initialised yet, truncated or overwritten)");
  }
  Locator l;
  l.pid = Load<uint32_t>(buf, 12);
  l.fd = Load<int32_t>(buf, 16);
  l.kind = Load<uint32_t>(buf, 20);
  l.owner_start = Load<uint64_t>(buf, 24);
  l.size = Load<uint64_t>(buf, 32);
  l.ino = Load<uint64_t>(buf, 40);
  l.dev = Load<uint64_t>(buf, 48);
  if (l.pid == 0 || l.pid > 0x3fffffffu || l.fd < 0 || l.kind < kKindPool || l.kind > kKindTable || l.size < kHeaderSize ||
      l.size > kMaxSegmentBytes) {
    return Status::Fail(kInvalidInput, "segment " + name + " has a locator with fields out of range");
  }
  *out = l;
  return Status::Ok();
}

Status OpenSegment(const std::string& name, uint64_t max_size, Mapping* out) {
  Locator loc;
  Status ls = ReadLocator(name, &loc);
  if (!ls.ok()) return ls;
  if (loc.size > max_size) {
    return Status::Fail(kInvalidInput, "segment " + name + " is larger than the allowed " + std::to_string(max_size) + " bytes");
  }
  char proc[64];
  std::snprintf(proc, sizeof proc, "/proc/%u/fd/%d", loc.pid, loc.fd);
  int fd = open(proc, O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    std::string why = e == ENOENT ? " (its creator, pid " + std::to_string(loc.pid) + ", freed it or exited, or is not in this PID namespace)"
                      : e == EACCES || e == EPERM
                          ? " (the creator's /proc/" + std::to_string(loc.pid) + "/fd is not accessible: another user, a non-dumpable process, or /proc mounted with hidepid)"
                          : "";
    return Status::Errno(e == EMFILE || e == ENFILE ? kResourceExhausted : kInvalidInput, "open " + name + why, "open", e);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    return Status::Errno(kInvalidInput, "open " + name, "fstat", e);
  }
  auto refuse = [&](const std::string& why) {
    close(fd);
    return Status::Fail(kInvalidInput, "segment " + name + " " + why);
  };
  if (static_cast<uint64_t>(st.st_ino) != loc.ino || static_cast<uint64_t>(st.st_dev) != loc.dev) {
    // The creator closed the memfd and reused the descriptor number: the segment is gone.
    close(fd);
    return Status::Errno(kInvalidInput, "open " + name + " (its creator freed it)", "open", ENOENT);
  }
  if (!S_ISREG(st.st_mode)) return refuse("is not a regular shared-memory object");
  if (st.st_uid != geteuid()) return refuse("belongs to uid " + std::to_string(st.st_uid) + ", not to this user");
  if ((st.st_mode & 0077) != 0) return refuse("is accessible to other users (mode must be 0600)");
  struct statfs sf;
  if (fstatfs(fd, &sf) != 0 || static_cast<uint64_t>(sf.f_type) != static_cast<uint64_t>(TMPFS_MAGIC)) {
    return refuse("is not a tmpfs memfd");
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & kSeals) != kSeals) return refuse("is not sealed against shrinking, growing and new seals");
  uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size != loc.size) return refuse("has " + std::to_string(size) + " bytes, its locator says " + std::to_string(loc.size));
  if (size < kHeaderSize) return refuse("is smaller than its header");
  if (size > max_size || size > kMaxSegmentBytes) return refuse("is larger than the allowed " + std::to_string(max_size) + " bytes");
  // No MAP_POPULATE here: a reader's first-touch faults are read faults, which map 16 pages
  // each (fault-around), so prefaulting would only move the same cost into id -> view and
  // charge it to readers that look at part of a slot.
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (addr == MAP_FAILED) return Status::Errno(e == ENOMEM ? kResourceExhausted : kInvalidInput, "open " + name, "mmap", e);
  out->addr = addr;
  out->size = size;
  out->fd = -1;
  return Status::Ok();
}

Status UnlinkSegment(const std::string& name, bool* existed) {
  std::string problem = NameProblem(name);
  if (!problem.empty()) return Status::Fail(kInvalidInput, problem);
  *existed = true;
  if (unlink(LocatorPath(name).c_str()) != 0) {
    if (errno == ENOENT) {
      *existed = false;
      return Status::Ok();
    }
    return Status::Errno(kInvalidInput, "unlink " + name, "unlink", errno);
  }
  return Status::Ok();
}

Status DecodeHeader(const uint8_t* base, size_t size, uint32_t require_kind, const std::string& expect_id, Meta* out) {
  Meta m;
  Status s = DecodeStatic(base, size, require_kind, expect_id, &m);
  if (!s.ok()) return s;
  if (m.kind == kKindPool) {
    s = SeqRead(base, size, &m, nullptr, 0, 100000);
    if (!s.ok()) return s;
  } else {
    m.generation = __atomic_load_n(AtomicAt<uint64_t>(base, off::generation), __ATOMIC_ACQUIRE);
  }
  *out = m;
  return Status::Ok();
}

Status SeqCopy(const uint8_t* base, size_t size, const std::string& expect_id, uint8_t* dst, size_t dst_len,
               uint32_t max_attempts, Meta* out) {
  Meta m;
  Status s = DecodeStatic(base, size, kKindPool, expect_id, &m);
  if (!s.ok()) return s;
  if (m.device != -1) return Status::Fail(kInvalidInput, "slot " + m.id + " holds cuda memory, not host memory");
  if (m.state != kStateLive) return Status::Fail(kClosed, "slot " + m.id + " was freed by its owner");
  s = SeqRead(base, size, &m, dst, dst_len, max_attempts == 0 ? 100000 : max_attempts);
  if (!s.ok()) return s;
  *out = m;
  return Status::Ok();
}

Status SeqCopyRange(const uint8_t* base, size_t size, uint64_t offset, uint64_t length, uint8_t* dst, size_t dst_len,
                    uint32_t max_attempts, uint64_t* generation_out) {
  Meta m;
  Status s = DecodeStatic(base, size, kKindPool, "", &m);
  if (!s.ok()) return s;
  if (m.device != -1) return Status::Fail(kInvalidInput, "slot " + m.id + " holds cuda memory, not host memory");
  // Bounds from the mapping size (fstat), never from the caller alone; overflow-safe.
  // DecodeStatic has checked size >= kDataOffset + capacity for a host slot.
  uint64_t data_end = static_cast<uint64_t>(size);
  if (offset < kDataOffset || offset > data_end || length > data_end - offset) {
    return Status::Fail(kInvalidInput, "range " + std::to_string(offset) + "+" + std::to_string(length) + " is outside the data of slot " +
                                           m.id + " (bytes " + std::to_string(kDataOffset) + ".." + std::to_string(data_end) + ")");
  }
  if (dst == nullptr || length > dst_len) {
    return Status::Fail(kInvalidInput, "destination of " + std::to_string(dst_len) + " bytes is smaller than the range (" +
                                           std::to_string(length) + " bytes)");
  }
  uint64_t g = 0;
  s = SeqReadLoop(base, max_attempts == 0 ? 100000 : max_attempts, [&](uint64_t g1) -> Status {
    std::memcpy(dst, base + offset, static_cast<size_t>(length));
    g = g1;
    return Status::Ok();
  });
  if (!s.ok()) return Status::Fail(s.code, "slot " + m.id + ": " + s.message);
  if (generation_out != nullptr) *generation_out = g;
  return Status::Ok();
}

Status SeqWrite(uint8_t* base, size_t size, uint64_t owner_capacity, const uint8_t* src, size_t len, uint32_t dtype,
                const std::vector<uint64_t>& shape, uint64_t* generation_out) {
  Meta m;
  Status s = DecodeStatic(base, size, kKindPool, "", &m);
  if (!s.ok()) return s;
  if (m.device != -1) return Status::Fail(kInvalidInput, "slot " + m.id + " holds cuda memory; use a device copy");
  // The owner's capacity (what it allocated) is the truth; the header must agree.
  if (m.capacity != owner_capacity || owner_capacity != size - kDataOffset) {
    return Status::Fail(kInvalidInput, "segment header: capacity " + std::to_string(m.capacity) +
                                           " differs from the owner's " + std::to_string(owner_capacity) + " (tampered header)");
  }
  if (m.state != kStateLive) return Status::Fail(kClosed, "slot " + m.id + " is not live");
  Meta nm = m;
  nm.byte_length = len;
  nm.dtype = dtype;
  nm.ndim = static_cast<uint32_t>(shape.size());
  if (shape.size() > kMaxNdim) return Status::Fail(kInvalidInput, "too many dimensions");
  for (size_t i = 0; i < shape.size(); i++) nm.shape[i] = shape[i];
  s = CheckTensorMeta(nm);
  if (!s.ok()) return Status::Fail(kInvalidInput, "write of " + std::to_string(len) + " bytes: " + s.message);

  uint64_t* gen = AtomicAt<uint64_t>(base, off::generation);
  uint64_t g = __atomic_load_n(gen, __ATOMIC_RELAXED);
  uint32_t spins = 0;
  for (;;) {
    if ((g & 1u) == 0 &&
        __atomic_compare_exchange_n(gen, &g, g + 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      break;
    }
    if (++spins > 200000) return Status::Fail(kTimedOut, "slot " + m.id + " is write-locked by another writer");
    CpuRelax(spins);
    g = __atomic_load_n(gen, __ATOMIC_RELAXED);
  }
  // Release fence: the odd generation is ordered before every data store below
  // (Boehm, "Can seqlocks get along with programming language memory models?").
  __atomic_thread_fence(__ATOMIC_RELEASE);
  std::memcpy(base + kDataOffset, src, len);
  Store<uint64_t>(base, off::byte_length, nm.byte_length);
  Store<uint32_t>(base, off::dtype, nm.dtype);
  Store<uint32_t>(base, off::ndim, nm.ndim);
  for (uint32_t i = 0; i < kMaxNdim; i++) Store<uint64_t>(base, off::shape + 8 * i, i < nm.ndim ? nm.shape[i] : 0);
  // Publish with release: a reader that acquires g + 2 sees all of the above.
  __atomic_store_n(gen, g + 2, __ATOMIC_RELEASE);
  *generation_out = g + 2;
  return Status::Ok();
}

bool SeqCheck(const uint8_t* base, size_t size, uint64_t generation) {
  if (base == nullptr || size < kHeaderSize || !Aligned(base)) return false;
  // The caller's data reads happened before this call; the fence keeps them before the load.
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  uint64_t g = __atomic_load_n(AtomicAt<uint64_t>(base, off::generation), __ATOMIC_RELAXED);
  if (g != generation) return false;
  return __atomic_load_n(AtomicAt<uint32_t>(base, off::state), __ATOMIC_ACQUIRE) == kStateLive;
}

// ---- batches ----

namespace {

constexpr double kMaxSafeInteger = 9007199254740991.0;

// A single read of a double that another thread may be writing (a SharedArrayBuffer):
// the value checked is the value used, never a second read of the memory.
inline double LoadOnce(const double* p) {
  uint64_t bits = __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_RELAXED);
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// A non-negative safe integer (NaN, infinities, negatives and fractions fail).
inline bool SafeInteger(double d) {
  // Below 2^53 the conversion to int64 is exact and one instruction (the unsigned one is not).
  return d >= 0 && d <= kMaxSafeInteger && d == static_cast<double>(static_cast<int64_t>(d));
}

double RealtimeMs() {
  timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<double>(t.tv_sec) * 1000.0 + static_cast<double>(t.tv_nsec) / 1e6;
}

bool Fail(BatchFailure* f, const char* code, const char* remote_code, std::string message) {
  f->code = code;
  f->remote_code = remote_code;
  f->message = std::move(message);
  return false;
}

inline void CopyPart(const BatchInput& in, const BatchRange& r, uint64_t from, uint64_t to) {
  uint8_t* remote = in.segments[r.segment].base + r.remote_at + from;
  uint8_t* local = in.locals[r.local].data + r.local_offset + from;
  if (in.write) {
    std::memcpy(remote, local, static_cast<size_t>(to - from));
  } else {
    std::memcpy(local, remote, static_cast<size_t>(to - from));
  }
}
inline void CopyRange(const BatchInput& in, const BatchRange& r) { CopyPart(in, r, 0, r.length); }

// The caller cancelled the batch (BatchInput::control).
inline bool Stopped(const BatchInput& in) { return in.control != nullptr && __atomic_load_n(in.control, __ATOMIC_RELAXED) == kCopyCancelled; }

// Copy one range of a batch that can be stopped: false, with the range partly copied or not at
// all, once the caller cancelled it (checked first, then between steps of a large range).
bool CopyRangeUnlessStopped(const BatchInput& in, const BatchRange& r) {
  if (Stopped(in)) return false;
  if (in.control == nullptr || r.length <= kCancelStepBytes) {
    CopyRange(in, r);
    return true;
  }
  for (uint64_t from = 0; from < r.length; from += kCancelStepBytes) {
    if (from > 0 && Stopped(in)) return false;
    CopyPart(in, r, from, r.length - from > kCancelStepBytes ? from + kCancelStepBytes : r.length);
  }
  return true;
}

// A group of a batch's ranges: in.ranges[idx[k]] for k < n, or in.ranges[k] when idx is null.
struct Group {
  const BatchInput* in;
  const uint32_t* idx;
  size_t n;
  const BatchRange& at(size_t k) const { return in->ranges[idx != nullptr ? idx[k] : k]; }
};

// Where piece t of a group starts: range k, byte off of it.
struct Cut {
  size_t k = 0;
  uint64_t off = 0;
};

// A group copied by several threads: piece t copies bytes [cuts[t], cuts[t + 1]) of the
// group's ranges in order, on whichever thread claims it (CopyPool). With a seqlocked segment
// (gen != nullptr) every piece re-checks the generation after its copies, in the thread that
// made them (acquire fence, relaxed load), and clears `same` when it is not `g1`, the value
// loaded (acquire) before any piece started.
struct ParallelCopy {
  Group group;
  Cut cuts[kParallelMaxPieces + 1];
  const uint64_t* gen = nullptr;
  uint64_t g1 = 0;
  std::atomic<bool> same{true};
  // A piece found the batch cancelled and copied nothing.
  std::atomic<bool> stopped{false};
};

void CopyPiece(uint32_t t, void* ctx) {
  ParallelCopy& pc = *static_cast<ParallelCopy*>(ctx);
  if (Stopped(*pc.group.in)) {
    pc.stopped.store(true, std::memory_order_relaxed);
    return;
  }
  const Cut a = pc.cuts[t];
  const Cut b = pc.cuts[t + 1];
  for (size_t k = a.k; k < pc.group.n && k <= b.k; k++) {
    const BatchRange& r = pc.group.at(k);
    uint64_t from = k == a.k ? a.off : 0;
    uint64_t to = k == b.k ? b.off : r.length;
    if (to > from) CopyPart(*pc.group.in, r, from, to);
  }
  if (pc.gen != nullptr) {
    // The reader protocol's re-check, in the thread that made the copies.
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(pc.gen, __ATOMIC_RELAXED) != pc.g1) pc.same.store(false, std::memory_order_relaxed);
  }
}

// Pieces for a group of `total` bytes (1: copy it on this thread).
uint32_t PiecesFor(const BatchInput& in, uint64_t total) {
  if (in.threads <= 1 || in.pool == nullptr || total < kParallelMinBytes) return 1;
  uint64_t n = total / kParallelPieceBytes;
  if (n > kParallelMaxPieces) n = kParallelMaxPieces;
  return n < 2 ? 1 : static_cast<uint32_t>(n);
}

// Copy a group in `pieces` pieces (>= 2) on the batch's threads; with `gen`, returns whether
// every piece saw the generation g1 (true without one). `*stopped`: a piece found the batch
// cancelled (every piece has ended either way).
bool CopyGroupParallel(const Group& g, uint64_t total, uint32_t pieces, const uint64_t* gen, uint64_t g1, bool* stopped) {
  ParallelCopy pc{g, {}, gen, g1, {}, {}};
  pc.same.store(true, std::memory_order_relaxed);
  pc.stopped.store(false, std::memory_order_relaxed);
  // Cut points by bytes, in one pass over the group.
  pc.cuts[0] = Cut{0, 0};
  uint64_t acc = 0;
  size_t k = 0;
  for (uint32_t t = 1; t < pieces; t++) {
    uint64_t target = total / pieces * t;
    while (k < g.n && acc + g.at(k).length <= target) acc += g.at(k++).length;
    pc.cuts[t] = Cut{k, target - acc};
  }
  pc.cuts[pieces] = Cut{g.n, 0};
  g.in->pool->Run(pieces, g.in->threads, CopyPiece, &pc);
  *stopped = pc.stopped.load(std::memory_order_relaxed);
  return pc.same.load(std::memory_order_relaxed);
}

bool FailStopped(BatchFailure* f) { return Fail(f, kAborted, "", "the copy was cancelled (its transfer was aborted or timed out)"); }

// Copy a group (no seqlock): in pieces over the batch's threads when it is large. False (f
// set) when the batch was cancelled before or during it.
bool CopyGroup(const Group& g, BatchFailure* f) {
  if (g.in->threads > 1) {
    uint64_t total = 0;
    for (size_t k = 0; k < g.n; k++) total += g.at(k).length;
    uint32_t pieces = PiecesFor(*g.in, total);
    if (pieces > 1) {
      bool stopped = false;
      CopyGroupParallel(g, total, pieces, nullptr, 0, &stopped);
      return stopped ? FailStopped(f) : true;
    }
  }
  for (size_t k = 0; k < g.n; k++) {
    if (!CopyRangeUnlessStopped(*g.in, g.at(k))) return FailStopped(f);
  }
  return true;
}

// The seqlock reader protocol (invariant 11) over every range of one segment at once: acquire
// load of the generation, plain copies of all the ranges, acquire fence, relaxed re-load; a
// changed generation drops the copies and repeats them all, so the ranges are one snapshot.
// Copied by several threads (a large group), the load comes first, before any piece starts,
// and every piece re-checks after its own copies: the snapshot holds only if all saw g1.
bool SeqCopySegment(const BatchInput& in, uint32_t s, const uint32_t* idx, size_t n, uint64_t* generation_out,
                    BatchFailure* f) {
  const uint64_t* gen = AtomicAt<uint64_t>(in.segments[s].base, off::generation);
  const Group group{&in, idx, n};
  uint32_t pieces = 1;
  uint64_t total = 0;
  if (in.threads > 1) {
    for (size_t k = 0; k < n; k++) total += group.at(k).length;
    pieces = PiecesFor(in, total);
  }
  const bool has_deadline = in.deadline_ms > 0;
  const uint64_t started = MonotonicNs();
  uint64_t stuck_value = 0;
  uint32_t stuck_polls = 0;
  uint64_t stuck_since = 0;
  uint32_t polls = 0;
  uint32_t attempt = 0;
  auto deadline_passed = [&] { return has_deadline && RealtimeMs() > in.deadline_ms; };
  for (;;) {
    // Acquire: none of the copies below moves above this load.
    uint64_t g1 = __atomic_load_n(gen, __ATOMIC_ACQUIRE);
    if (g1 & 1u) {
      // A write is in progress: wait, bounded per write (a writer stuck on one odd value died
      // mid-write) and by the caller's deadline.
      if (g1 != stuck_value) {
        stuck_value = g1;
        stuck_polls = 0;
        stuck_since = 0;
      }
      ++stuck_polls;
      if ((++polls & 1023u) == 0 || stuck_polls == 1) {
        uint64_t now = MonotonicNs();
        if (stuck_since == 0) stuck_since = now;
        if (now - stuck_since > kStuckWriterNs) {
          return Fail(f, kTimedOut, "", "segment stayed write-locked (a writer is busy or died mid-write)");
        }
        if (deadline_passed()) return Fail(f, kTimedOut, "", "deadline passed while the slot was write-locked");
        if (Stopped(in)) return FailStopped(f);
      }
      CpuRelax(stuck_polls);
      continue;
    }
    bool same;
    if (pieces > 1) {
      // Every piece re-checked the generation itself (CopyPiece); the pieces have all ended.
      bool stopped = false;
      same = CopyGroupParallel(group, total, pieces, gen, g1, &stopped);
      if (stopped) return FailStopped(f);
    } else {
      for (size_t k = 0; k < n; k++) {
        if (!CopyRangeUnlessStopped(in, group.at(k))) return FailStopped(f);
      }
      // Acquire fence: the copies above complete before the re-check below.
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
      same = __atomic_load_n(gen, __ATOMIC_RELAXED) == g1;
    }
    if (same) {
      // A slot its owner freed (state no longer live) is refused, never read: its name may
      // stand for a new slot by now (SeqCheck's rule, after the copies like the re-check).
      if (__atomic_load_n(AtomicAt<uint32_t>(in.segments[s].base, off::state), __ATOMIC_ACQUIRE) != kStateLive) {
        f->segment = static_cast<int64_t>(s);
        return Fail(f, kRemoteRejected, "gone", "the pool slot was freed by its owner");
      }
      *generation_out = g1;
      return true;
    }
    if (deadline_passed()) return Fail(f, kTimedOut, "", "deadline passed while the slot was being rewritten");
    if (Stopped(in)) return FailStopped(f);
    if (++attempt >= in.max_attempts || MonotonicNs() - started > kReadDeadlineNs) {
      return Fail(f, kRemoteRejected, "slot-rewritten",
                  "the pool slot was rewritten during every one of " + std::to_string(attempt) +
                      " copies of its ranges; read again");
    }
  }
}

bool CopyAll(const BatchInput& in, std::vector<uint32_t>* order, uint64_t* generations, BatchFailure* f) {
  bool any_seq = false;
  for (size_t s = 0; s < in.n_segments; s++) {
    generations[s] = 0;
    any_seq = any_seq || in.segments[s].seqlocked;
  }
  if (in.write || !any_seq) return CopyGroup(Group{&in, nullptr, in.count}, f);
  // Group the ranges by segment (counting sort, stable): order[0..n_segments] are the start
  // offsets, then the range indices segment by segment.
  const size_t ns = in.n_segments;
  order->assign(ns + 1 + in.count, 0);
  uint32_t* start = order->data();
  uint32_t* idx = start + ns + 1;
  for (size_t i = 0; i < in.count; i++) start[in.ranges[i].segment + 1]++;
  for (size_t s = 0; s < ns; s++) start[s + 1] += start[s];
  {
    std::vector<uint32_t> fill(start, start + ns);
    for (size_t i = 0; i < in.count; i++) idx[fill[in.ranges[i].segment]++] = static_cast<uint32_t>(i);
  }
  for (size_t s = 0; s < ns; s++) {
    const uint32_t* first = idx + start[s];
    size_t n = start[s + 1] - start[s];
    if (n == 0) continue;
    if (!in.segments[s].seqlocked) {
      if (!CopyGroup(Group{&in, first, n}, f)) return false;
    } else if (!SeqCopySegment(in, static_cast<uint32_t>(s), first, n, &generations[s], f)) {
      f->segment = static_cast<int64_t>(s);
      return false;
    }
  }
  return true;
}

}  // namespace

bool DecodeBatchRange(const double* at, size_t stride, size_t i, const BatchInput& in, BatchRange* out, BatchFailure* f) {
  f->range = static_cast<int64_t>(i);
  // One read of each value (the array may be shared with another thread), then checks.
  double r[kBatchFields];
  for (size_t k = 0; k < kBatchFields; k++) r[k] = LoadOnce(at + i * stride + k);
  static const char* const kFields[kBatchFields] = {"request", "local", "localOffset", "remote", "remoteOffset", "length", "remoteRange"};
  for (size_t k = 0; k < kBatchFields; k++) {
    if (!SafeInteger(r[k])) {
      return Fail(f, kInvalidInput, "", "range " + std::to_string(i) + ": " + kFields[k] + " is not a non-negative safe integer");
    }
  }
  const uint64_t li = static_cast<uint64_t>(r[1]);
  const uint64_t lo = static_cast<uint64_t>(r[2]);
  const uint64_t ri = static_cast<uint64_t>(r[3]);
  const uint64_t ro = static_cast<uint64_t>(r[4]);
  const uint64_t len = static_cast<uint64_t>(r[5]);
  const uint64_t rr = static_cast<uint64_t>(r[6]);
  // The message names the range; built only on a failure (this runs once per range of a batch).
  auto which = [i] { return "range " + std::to_string(i); };
  if (li >= in.n_locals) return Fail(f, kInvalidInput, "", which() + ": local " + std::to_string(li) + " is not in the batch");
  if (ri >= in.n_remotes) return Fail(f, kInvalidInput, "", which() + ": remote " + std::to_string(ri) + " is not in the batch");
  if (len == 0) return Fail(f, kInvalidInput, "", which() + " is empty");
  const BatchRemote& remote = in.remotes[ri];
  if (rr >= remote.count) {
    return Fail(f, kInvalidInput, "", which() + ": remote range " + std::to_string(rr) + " does not exist (the remote has " + std::to_string(remote.count) + ")");
  }
  const BatchLocal& local = in.locals[li];
  if (len > local.size || lo > local.size - len) {
    return Fail(f, kInvalidInput, "", which() + ": local bytes " + std::to_string(lo) + "+" + std::to_string(len) + " exceed the local buffer of " +
                                          std::to_string(local.size) + " bytes");
  }
  // The span of the granted range, read once (CheckBatchTables checked first + count <= n_spans).
  const double* sp = in.spans + (remote.first + rr) * kSpanFields;
  const double sd = LoadOnce(sp), bd = LoadOnce(sp + 1), ld = LoadOnce(sp + 2);
  if (!SafeInteger(sd) || !SafeInteger(bd) || !SafeInteger(ld) || sd >= static_cast<double>(in.n_segments)) {
    return Fail(f, kInvalidInput, "", which() + ": the span of remote range " + std::to_string(rr) + " is malformed or names a segment that is not in the batch");
  }
  const BatchSegment& seg = in.segments[static_cast<size_t>(sd)];
  const uint64_t base = static_cast<uint64_t>(bd);
  const uint64_t limit = static_cast<uint64_t>(ld);
  // The granted bytes lie in the segment's data area, never in its header, and inside the
  // mapping (whose size came from fstat).
  if (seg.base == nullptr || base < kDataOffset || base > seg.size || limit > seg.size - base) {
    return Fail(f, kInvalidInput, "", which() + ": granted bytes " + std::to_string(base) + "+" + std::to_string(limit) +
                                          " lie outside the data of their segment (" + std::to_string(seg.size) + " bytes)");
  }
  if (len > limit || ro > limit - len) {
    return Fail(f, kRemoteRejected, "bounds", which() + ": remote bytes " + std::to_string(ro) + "+" + std::to_string(len) + " exceed the granted range of " +
                                                  std::to_string(limit) + " bytes");
  }
  if (in.write && seg.seqlocked) {
    return Fail(f, kRemoteRejected, "read-only", which() + ": the remote is a pool slot; peers may read it, only its owner writes it");
  }
  out->local = static_cast<uint32_t>(li);
  out->local_offset = lo;
  out->segment = static_cast<uint32_t>(sd);
  out->remote_at = base + ro;
  out->length = len;
  f->range = -1;
  return true;
}

double BatchLoadOnce(const double* p) { return LoadOnce(p); }

double BatchNowMs() { return RealtimeMs(); }

bool CheckBatchTables(const BatchInput& in, BatchFailure* f) {
  for (size_t s = 0; s < in.n_segments; s++) {
    const BatchSegment& seg = in.segments[s];
    if (!seg.seqlocked) continue;
    Meta m;
    Status st = DecodeStatic(seg.base, seg.size, kKindPool, "", &m);
    if (st.ok() && m.device != -1) st = Status::Fail(kInvalidInput, "slot " + m.id + " holds cuda memory, not host memory");
    if (!st.ok()) {
      f->segment = static_cast<int64_t>(s);
      return Fail(f, st.code, "", "segment " + std::to_string(s) + ": " + st.message);
    }
    if (m.state != kStateLive) {
      // Freed by its owner before the batch: refused before any byte moves (one freed during
      // the copies is refused after them, SeqCopySegment).
      f->segment = static_cast<int64_t>(s);
      return Fail(f, kRemoteRejected, "gone", "segment " + std::to_string(s) + ": slot " + m.id + " was freed by its owner");
    }
  }
  for (size_t r = 0; r < in.n_remotes; r++) {
    const BatchRemote& rem = in.remotes[r];
    if (rem.grant >= in.n_grants) {
      return Fail(f, kInvalidInput, "", "remote " + std::to_string(r) + " names a grant that is not in the batch");
    }
    if (rem.count == 0 || rem.first > in.n_spans || rem.count > in.n_spans - rem.first) {
      return Fail(f, kInvalidInput, "", "remote " + std::to_string(r) + ": spans " + std::to_string(rem.first) + "+" + std::to_string(rem.count) +
                                            " are not in the span table of " + std::to_string(in.n_spans));
    }
  }
  for (size_t g = 0; g < in.n_grants; g++) {
    const BatchGrant& gr = in.grants[g];
    if (gr.token == nullptr) return Fail(f, kInvalidInput, "", "grant " + std::to_string(g) + " has no token");
    if (gr.record != 0) {
      TableGeometry geo;
      Status st = CheckTable(gr.base, gr.size, &geo);
      if (st.ok() && (gr.record < kHeaderSize || (gr.record - kHeaderSize) % kRecordBytes != 0 || (gr.record - kHeaderSize) / kRecordBytes >= geo.records)) {
        st = Status::Fail(kInvalidInput, "byte " + std::to_string(gr.record) + " is not a record of the table");
      }
      if (!st.ok()) {
        f->grant = static_cast<int64_t>(g);
        return Fail(f, kInvalidInput, "", "grant " + std::to_string(g) + ": " + st.message);
      }
    }
  }
  return true;
}

bool RunBatch(const BatchInput& in, std::vector<uint32_t>* order, uint64_t* generations, BatchFailure* f) {
  auto leave = [&](size_t k) {
    const BatchGrant& g = in.grants[k];
    if (g.record != 0) {
      RecordLeave(g.base, g.size, g.record);
    } else {
      GrantLeave(g.base, g.size);
    }
  };
  size_t entered = 0;
  for (; entered < in.n_grants; entered++) {
    const BatchGrant& g = in.grants[entered];
    GrantResult r = g.record != 0 ? RecordEnter(g.base, g.size, g.record, g.generation, g.token, kTokenBytes) : GrantEnter(g.base, g.size, g.token, kTokenBytes);
    if (r != kGrantOk) {
      for (size_t k = 0; k < entered; k++) leave(k);
      f->grant = static_cast<int64_t>(entered);
      const char* rc = r == kGrantRevoked ? "revoked" : r == kGrantBadToken ? "bad-token" : "bad-grant";
      const char* why = r == kGrantRevoked ? "was revoked" : r == kGrantBadToken ? "rejected the token" : "is not a grant";
      return Fail(f, kRemoteRejected, rc, std::string("grant ") + std::to_string(entered) + " " + why);
    }
  }
  bool ok = CopyAll(in, order, generations, f);
  for (size_t k = 0; k < in.n_grants; k++) leave(k);
  return ok;
}

Status SetState(uint8_t* base, size_t size, uint32_t state) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  if (state > kStateDead) return Status::Fail(kInvalidInput, "unknown state");
  __atomic_store_n(AtomicAt<uint32_t>(base, off::state), state, __ATOMIC_SEQ_CST);
  return Status::Ok();
}

uint32_t LoadState(const uint8_t* base, size_t size) {
  if (!BasicChecks(base, size).ok()) return kStateDead;
  return __atomic_load_n(AtomicAt<uint32_t>(base, off::state), __ATOMIC_SEQ_CST);
}

Status ImporterAdd(uint8_t* base, size_t size, bool* live) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  uint32_t* imp = AtomicAt<uint32_t>(base, off::importers);
  __atomic_fetch_add(imp, 1u, __ATOMIC_SEQ_CST);
  *live = __atomic_load_n(AtomicAt<uint32_t>(base, off::state), __ATOMIC_SEQ_CST) == kStateLive;
  if (!*live) {
    uint32_t r;
    ImporterRemove(base, size, &r);
  }
  return Status::Ok();
}

Status ImporterRemove(uint8_t* base, size_t size, uint32_t* remaining) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  uint32_t* imp = AtomicAt<uint32_t>(base, off::importers);
  uint32_t cur = __atomic_load_n(imp, __ATOMIC_RELAXED);
  do {
    if (cur == 0) {
      *remaining = 0;
      return Status::Ok();
    }
  } while (!__atomic_compare_exchange_n(imp, &cur, cur - 1, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  *remaining = cur - 1;
  return Status::Ok();
}

uint32_t LoadImporters(const uint8_t* base, size_t size) {
  if (!BasicChecks(base, size).ok()) return 0;
  return __atomic_load_n(AtomicAt<uint32_t>(base, off::importers), __ATOMIC_SEQ_CST);
}

GrantResult GrantEnter(uint8_t* base, size_t size, const uint8_t* token, size_t token_len) {
  if (!BasicChecks(base, size).ok() || Load<uint32_t>(base, off::kind) != kKindGrant) return kGrantNotGrant;
  uint32_t* active = AtomicAt<uint32_t>(base, off::active);
  __atomic_fetch_add(active, 1u, __ATOMIC_SEQ_CST);
  // seq_cst pairs with GrantRevoke's store: either revoke sees active > 0 and waits, or we
  // see the revoked state here and back out.
  uint32_t state = __atomic_load_n(AtomicAt<uint32_t>(base, off::state), __ATOMIC_SEQ_CST);
  if (state != kStateLive) {
    __atomic_fetch_sub(active, 1u, __ATOMIC_SEQ_CST);
    return kGrantRevoked;
  }
  uint8_t diff = token_len == kTokenBytes ? 0 : 1;
  for (size_t i = 0; i < kTokenBytes; i++) {
    uint8_t t = __atomic_load_n(base + off::grant_token + i, __ATOMIC_RELAXED);
    diff |= static_cast<uint8_t>(t ^ (i < token_len ? token[i] : 0));
  }
  if (diff != 0) {
    __atomic_fetch_sub(active, 1u, __ATOMIC_SEQ_CST);
    return kGrantBadToken;
  }
  return kGrantOk;
}

void GrantLeave(uint8_t* base, size_t size) {
  if (!BasicChecks(base, size).ok()) return;
  uint32_t* active = AtomicAt<uint32_t>(base, off::active);
  uint32_t cur = __atomic_load_n(active, __ATOMIC_RELAXED);
  while (cur > 0 && !__atomic_compare_exchange_n(active, &cur, cur - 1, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
}

uint32_t GrantActive(const uint8_t* base, size_t size) {
  if (!BasicChecks(base, size).ok()) return 0;
  return __atomic_load_n(AtomicAt<uint32_t>(base, off::active), __ATOMIC_SEQ_CST);
}

Status GrantRevoke(uint8_t* base, size_t size) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  if (Load<uint32_t>(base, off::kind) != kKindGrant) return Status::Fail(kInvalidInput, "not a grant segment");
  __atomic_store_n(AtomicAt<uint32_t>(base, off::state), static_cast<uint32_t>(kStateDead), __ATOMIC_SEQ_CST);
  for (size_t i = 0; i < kTokenBytes; i++) __atomic_store_n(base + off::grant_token + i, static_cast<uint8_t>(0), __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  return Status::Ok();
}

// ---- range-grant records ----

Status CheckTable(const uint8_t* base, size_t size, TableGeometry* out) {
  Status s = BasicChecks(base, size);
  if (!s.ok()) return s;
  if (Load<uint32_t>(base, off::kind) != kKindTable) return Status::Fail(kInvalidInput, "segment is not a grant table");
  TableGeometry g;
  g.records = Load<uint32_t>(base, off::table_records);
  g.dir = Load<uint32_t>(base, off::table_dir);
  g.arena = Load<uint64_t>(base, off::table_arena);
  if (g.records == 0 || g.records > kMaxTableRecords || g.dir == 0 || g.dir > kMaxTableDir || g.arena > kMaxTableArena || g.arena % 8 != 0) {
    return Status::Fail(kInvalidInput, "grant table geometry is out of range");
  }
  // Every term is bounded above, so the sum cannot overflow.
  if (kHeaderSize + g.records * kRecordBytes + g.dir * kDirEntryBytes + g.arena != size) {
    return Status::Fail(kInvalidInput, "grant table geometry does not match the segment size " + std::to_string(size));
  }
  *out = g;
  return Status::Ok();
}

namespace {
// The record at `offset` of a valid table, or nullptr.
uint8_t* RecordAt(uint8_t* base, size_t size, uint64_t offset) {
  TableGeometry g;
  if (!CheckTable(base, size, &g).ok()) return nullptr;
  if (offset < kHeaderSize || (offset - kHeaderSize) % kRecordBytes != 0 || (offset - kHeaderSize) / kRecordBytes >= g.records) return nullptr;
  return base + offset;
}
}  // namespace

GrantResult RecordEnter(uint8_t* base, size_t size, uint64_t offset, uint64_t generation, const uint8_t* token, size_t token_len) {
  uint8_t* r = RecordAt(base, size, offset);
  if (r == nullptr) return kGrantNotGrant;
  uint32_t* active = AtomicAt<uint32_t>(r, rec::active);
  __atomic_fetch_add(active, 1u, __ATOMIC_SEQ_CST);
  // seq_cst pairs with RecordRevoke's store of the state: either the owner sees active > 0
  // and waits, or this sees the record revoked (or reused: another generation) and backs out.
  uint32_t state = __atomic_load_n(AtomicAt<uint32_t>(r, rec::state), __ATOMIC_SEQ_CST);
  uint64_t gen = __atomic_load_n(AtomicAt<uint64_t>(r, rec::generation), __ATOMIC_SEQ_CST);
  if (state != kRecordLive || gen != generation) {
    __atomic_fetch_sub(active, 1u, __ATOMIC_SEQ_CST);
    return kGrantRevoked;
  }
  uint8_t diff = token_len == kTokenBytes ? 0 : 1;
  for (size_t i = 0; i < kTokenBytes; i++) {
    uint8_t t = __atomic_load_n(r + rec::token + i, __ATOMIC_RELAXED);
    diff |= static_cast<uint8_t>(t ^ (i < token_len ? token[i] : 0));
  }
  if (diff != 0) {
    __atomic_fetch_sub(active, 1u, __ATOMIC_SEQ_CST);
    return kGrantBadToken;
  }
  return kGrantOk;
}

void RecordLeave(uint8_t* base, size_t size, uint64_t offset) {
  uint8_t* r = RecordAt(base, size, offset);
  if (r == nullptr) return;
  uint32_t* active = AtomicAt<uint32_t>(r, rec::active);
  uint32_t cur = __atomic_load_n(active, __ATOMIC_RELAXED);
  while (cur > 0 && !__atomic_compare_exchange_n(active, &cur, cur - 1, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
}

uint32_t RecordActive(const uint8_t* base, size_t size, uint64_t offset) {
  uint8_t* r = RecordAt(const_cast<uint8_t*>(base), size, offset);
  if (r == nullptr) return 0;
  return __atomic_load_n(AtomicAt<uint32_t>(r, rec::active), __ATOMIC_SEQ_CST);
}

Status RecordPublish(uint8_t* base, size_t size, uint64_t offset, uint64_t generation) {
  uint8_t* r = RecordAt(base, size, offset);
  if (r == nullptr) return Status::Fail(kInvalidInput, "not a record of a grant table");
  __atomic_store_n(AtomicAt<uint64_t>(r, rec::generation), generation, __ATOMIC_SEQ_CST);
  // Publish: a peer that sees the record live (seq_cst load) sees its token and range table.
  __atomic_store_n(AtomicAt<uint32_t>(r, rec::state), static_cast<uint32_t>(kRecordLive), __ATOMIC_SEQ_CST);
  return Status::Ok();
}

Status WriteRangeTable(uint8_t* base, size_t size, uint64_t arena_offset, const double* ranges, size_t count, const double* regs, size_t nregs, double* result) {
  TableGeometry g;
  Status st = CheckTable(base, size, &g);
  if (!st.ok()) return st;
  // The range table must lie inside the arena, 8-byte aligned (u64 entries).
  if (count == 0 || arena_offset % 8 != 0 || arena_offset > g.arena || count > (g.arena - arena_offset) / kRangeEntryBytes) {
    return Status::Fail(kInvalidInput, "the range table does not fit the grant table's arena");
  }
  uint8_t* out = base + (size - g.arena) + arena_offset;  // the arena is the mapping's tail
  constexpr double kMaxExact = 9007199254740992.0;  // 2^53
  // Each value is converted to an integer once (truncating) and must convert back to itself:
  // NaN, fractions and values at or above 2^53 fail (the range compares are on the doubles).
  const double nr = static_cast<double>(nregs);
  double bytes = 0;
  for (size_t k = 0; k < count; k++) {
    const double j = ranges[3 * k];
    const double off = ranges[3 * k + 1];
    const double len = ranges[3 * k + 2];
    const int64_t ji = static_cast<int64_t>(j), oi = static_cast<int64_t>(off), li = static_cast<int64_t>(len);
    const bool shaped = j >= 0 && j < nr && off >= 0 && off < kMaxExact && len >= 1 && len < kMaxExact;
    if (shaped && static_cast<double>(ji) == j && static_cast<double>(oi) == off && static_cast<double>(li) == len) {
      const double* r = regs + 3 * ji;
      if (off + len <= r[2]) {
        // Three 8-byte stores (one 24-byte struct copied through the stack defeats store forwarding).
        uint8_t* e = out + k * kRangeEntryBytes;
        const int64_t dir = static_cast<int64_t>(r[0]), at = static_cast<int64_t>(r[1]) + oi;
        std::memcpy(e, &dir, 8);
        std::memcpy(e + 8, &at, 8);
        std::memcpy(e + 16, &li, 8);
        bytes += len;
        continue;
      }
    }
    *result = -static_cast<double>(k) - 1;
    return Status::Ok();
  }
  *result = bytes;
  return Status::Ok();
}

Status RecordRevoke(uint8_t* base, size_t size, uint64_t offset, uint64_t next_generation, uint32_t* active_out) {
  uint8_t* r = RecordAt(base, size, offset);
  if (r == nullptr) return Status::Fail(kInvalidInput, "not a record of a grant table");
  __atomic_store_n(AtomicAt<uint32_t>(r, rec::state), static_cast<uint32_t>(kRecordRevoked), __ATOMIC_SEQ_CST);
  for (size_t i = 0; i < kTokenBytes; i++) __atomic_store_n(r + rec::token + i, static_cast<uint8_t>(0), __ATOMIC_RELAXED);
  __atomic_store_n(AtomicAt<uint64_t>(r, rec::generation), next_generation, __ATOMIC_SEQ_CST);
  *active_out = __atomic_load_n(AtomicAt<uint32_t>(r, rec::active), __ATOMIC_SEQ_CST);
  return Status::Ok();
}

Status RecordFree(uint8_t* base, size_t size, uint64_t offset) {
  uint8_t* r = RecordAt(base, size, offset);
  if (r == nullptr) return Status::Fail(kInvalidInput, "not a record of a grant table");
  __atomic_store_n(AtomicAt<uint32_t>(r, rec::state), static_cast<uint32_t>(kRecordFree), __ATOMIC_SEQ_CST);
  return Status::Ok();
}

}  // namespace tw
