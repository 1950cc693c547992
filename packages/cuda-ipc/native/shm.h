// POSIX shared memory segments and the seqlock-protected header. No Node-API here, so
// the logic can be reasoned about (and fuzzed through the addon) on plain memory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "layout.h"

namespace tw {

class CopyPool;

// Error codes mirror @tensorwire/core's ErrorCode values.
extern const char* const kInvalidInput;
extern const char* const kResourceExhausted;
extern const char* const kRemoteRejected;
extern const char* const kTimedOut;
extern const char* const kBackendUnavailable;
extern const char* const kClosed;
extern const char* const kAborted;

struct Status {
  const char* code = nullptr;  // nullptr = ok
  std::string message;
  std::string syscall;
  int err = 0;
  bool ok() const { return code == nullptr; }
  static Status Ok() { return Status{}; }
  static Status Fail(const char* c, std::string m) {
    Status s;
    s.code = c;
    s.message = std::move(m);
    return s;
  }
  static Status Errno(const char* c, const std::string& what, const char* call, int e);
};

// Returns "" when the name is acceptable, else why not. Names are "/tw-" + [A-Za-z0-9._-],
// at most kMaxNameLength bytes, with no ".." and no further '/'.
std::string NameProblem(const std::string& name);

struct Mapping {
  void* addr = nullptr;
  size_t size = 0;
  // The creator's descriptor of the segment's memfd (-1 for a mapping opened by a reader):
  // it keeps /proc/<pid>/fd/<fd> resolvable for readers until the creator unlinks it.
  int fd = -1;
};

// Segments are sealed memfds (see CreateSegment); the name is a locator file
// /dev/shm<name> (mode 0600, kLocatorBytes) that readers use to find the memfd:
//   off size
//     0    8 magic "TWLOC" + format 1
//     8    4 version 1
//    12    4 creator pid
//    16    4 descriptor number of the memfd in the creator
//    20    4 kind (as in the header)
//    24    8 creator start time (pid-reuse guard)
//    32    8 segment size
//    40    8 inode of the memfd (st_ino), so a reused descriptor number is refused
//    48    8 device of the memfd (st_dev)
constexpr size_t kLocatorBytes = 64;
constexpr uint64_t kLocatorMagic = 0x5457434f4c000001ull;
struct Locator {
  uint32_t pid = 0;
  int32_t fd = -1;
  uint32_t kind = 0;
  uint64_t owner_start = 0;
  uint64_t size = 0;
  uint64_t ino = 0;
  uint64_t dev = 0;
};
// Read and validate the locator of `name` (pread, never mmap: a truncated or garbled locator
// is an error, never a SIGBUS). Refuses locators of another uid or accessible to others.
Status ReadLocator(const std::string& name, Locator* out);

struct InitParams {
  uint32_t kind = kKindPool;
  uint64_t data_offset = 0;
  uint64_t capacity = 0;
  uint32_t owner_pid = 0;
  int32_t device = -1;
  uint64_t owner_start = 0;
  uint64_t ipc_offset = 0;
  bool has_ipc_handle = false;
  uint8_t ipc_handle[kIpcHandleBytes] = {0};
  uint64_t byte_length = 0;
  uint32_t dtype = 0;
  std::vector<uint64_t> shape;
  std::string id;
};

// Exclusive create of the locator (O_CREAT|O_EXCL, 0600), then a memfd (mode 0600), sized,
// reserved (posix_fallocate) and sealed against shrinking, growing and further seals
// (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: no process, the creator included, can ever
// truncate it, so no mapping of it can fault with SIGBUS), mapped with every page prefaulted
// (MAP_POPULATE), header initialised, locator written. out->fd stays open (the caller keeps
// it until UnlinkSegment) so readers can open /proc/<pid>/fd/<fd>.
Status CreateSegment(const std::string& name, uint64_t size, const InitParams& p, Mapping* out);
// Open an existing segment through its locator: /proc/<pid>/fd/<fd>, which must be the
// memfd the locator names (inode, size), a tmpfs file of this uid, mode 0600, sealed
// against shrinking, growing and further seals. Refuses anything else.
Status OpenSegment(const std::string& name, uint64_t max_size, Mapping* out);
// Remove the locator; *existed=false on ENOENT. (The creator closes its memfd descriptor.)
Status UnlinkSegment(const std::string& name, bool* existed);

struct Meta {
  uint32_t kind = 0;
  uint32_t version = 0;
  uint32_t header_size = 0;
  uint64_t data_offset = 0;
  uint64_t capacity = 0;
  uint32_t owner_pid = 0;
  int32_t device = -1;
  uint64_t owner_start = 0;
  uint64_t ipc_offset = 0;
  uint8_t ipc_handle[kIpcHandleBytes] = {0};
  uint64_t generation = 0;
  uint32_t state = 0;
  uint32_t importers = 0;
  uint64_t byte_length = 0;
  uint32_t dtype = 0;
  uint32_t ndim = 0;
  uint64_t shape[kMaxNdim] = {0};
  std::string id;
};

size_t DtypeSize(uint32_t dtype);  // 0 for unknown

// Validate the static header fields against `size` (the mapping size learned from fstat or
// the owner, never from the header) and read a seqlock-consistent snapshot of the metadata.
// `require_kind` 0 = any. `expect_id` empty = don't check.
Status DecodeHeader(const uint8_t* base, size_t size, uint32_t require_kind, const std::string& expect_id,
                    Meta* out);
// Like DecodeHeader but also copies the data (host pool slots) into dst under the seqlock.
Status SeqCopy(const uint8_t* base, size_t size, const std::string& expect_id, uint8_t* dst, size_t dst_len,
               uint32_t max_attempts, Meta* out);
// A seqlock-consistent copy of bytes [offset, offset + length) of a host pool slot's
// mapping (offset counts from the start of the mapping, so it is >= the data offset) into
// dst: the reader protocol of SeqCopy (acquire-load, bounded wait while odd, copy, acquire
// fence, re-load, retry on change) without the tensor metadata. The range is checked
// against the mapping size. TW_TIMED_OUT when no consistent copy could be made.
Status SeqCopyRange(const uint8_t* base, size_t size, uint64_t offset, uint64_t length, uint8_t* dst, size_t dst_len,
                    uint32_t max_attempts, uint64_t* generation_out);
// ---- batches (the transport's one native call per stream batch) ----

// One range of a batch, decoded from the caller's Float64Array and validated: the local
// bytes [local_offset, +length) of local `local`, the remote bytes [remote_at, +length) of
// the mapping of segment `segment` (remote_at counts from the start of the mapping).
struct BatchRange {
  uint64_t local_offset = 0;
  uint64_t remote_at = 0;
  uint64_t length = 0;
  uint32_t local = 0;
  uint32_t segment = 0;
};
// A local host buffer (the caller's Uint8Array).
struct BatchLocal {
  uint8_t* data = nullptr;
  size_t size = 0;
};
// A data segment mapping (an ArrayBuffer from shmOpen, sized by fstat). Seqlocked: a host
// pool slot whose bytes its owner publishes under the header's seqlock.
struct BatchSegment {
  uint8_t* base = nullptr;
  size_t size = 0;
  bool seqlocked = false;
};
// What a batch enters before it copies: a grant segment (record == 0) or the range-grant
// record at byte `record` of a grant table mapping, entered with `token` (kTokenBytes) and,
// for a record, the `generation` the peer's payload names.
struct BatchGrant {
  uint8_t* base = nullptr;
  size_t size = 0;
  const uint8_t* token = nullptr;
  uint64_t record = 0;
  uint64_t generation = 0;
};
// A remote of the batch: the grant it is entered through and its granted ranges, spans
// [first, first + count) of the batch's span table. A whole registration is one span; a
// range grant has one span per granted range, and a range names its span by RemoteRange.
struct BatchRemote {
  uint32_t grant = 0;
  uint64_t first = 0;
  uint64_t count = 0;
};
struct BatchInput {
  bool write = false;
  const BatchRange* ranges = nullptr;
  size_t count = 0;
  const BatchLocal* locals = nullptr;
  size_t n_locals = 0;
  const BatchRemote* remotes = nullptr;
  size_t n_remotes = 0;
  // 3 numbers per span: segment index, base (offset of the granted bytes in the segment
  // mapping), limit (bytes granted). Read once per range that uses a span, then checked.
  const double* spans = nullptr;
  size_t n_spans = 0;
  const BatchSegment* segments = nullptr;
  size_t n_segments = 0;
  const BatchGrant* grants = nullptr;
  size_t n_grants = 0;
  // CLOCK_REALTIME milliseconds (Date.now()); 0 = none. Bounds waits and retries.
  double deadline_ms = 0;
  // Copies of one slot's ranges that overlapped a write and were retried, at most.
  uint32_t max_attempts = 0;
  // Threads that copy the batch's bytes (1 = the calling thread only). With more, and a pool,
  // a group of at least kParallelMinBytes is cut by bytes into pieces of at least
  // kParallelPieceBytes (at most kParallelMaxPieces; ranges may be cut) that the calling thread
  // and up to `threads - 1` pool threads claim one at a time; the seqlock protocol stays one
  // generation check per slot per batch: one acquire load of the generation before any piece
  // starts, then every piece re-checks it after its own copies (acquire fence, load), and the
  // copy counts only when all of them saw it unchanged.
  uint32_t threads = 1;
  CopyPool* pool = nullptr;
  // A copy off the JavaScript thread (copyPlannedAsync): the word its caller sets to
  // kCopyCancelled to stop it (null: none). Read before every range (a large range between
  // steps of kCancelStepBytes), at the start of every piece and in the seqlock waits; a
  // stopped batch fails with kAborted after every piece has ended.
  const int32_t* control = nullptr;
};
// The states of a copy's control word (BatchInput::control): queued (set by the caller), copying
// (the pool thread that starts it, by compare-and-swap from queued), cancelled (the caller).
constexpr int32_t kCopyQueued = 0;
constexpr int32_t kCopyRunning = 1;
constexpr int32_t kCopyCancelled = 2;
// A range at least this large is copied in steps of it when the batch can be stopped.
constexpr uint64_t kCancelStepBytes = 4ull << 20;
// Smallest group of bytes copied by more than one thread, smallest piece, most pieces per group.
constexpr uint64_t kParallelMinBytes = 1ull << 20;
constexpr uint64_t kParallelPieceBytes = 256ull << 10;
constexpr uint32_t kParallelMaxPieces = 64;
// Why a batch failed. `code` mirrors @tensorwire/core's error codes; `remote_code` is the
// RemoteRejectedError remoteCode when code is kRemoteRejected. Indices are -1 when n/a.
struct BatchFailure {
  const char* code = nullptr;
  std::string message;
  const char* remote_code = "";
  int64_t range = -1;
  int64_t grant = -1;
  int64_t segment = -1;
};

// Numbers per range the addon reads: core's RangeField Request, Local, LocalOffset, Remote,
// RemoteOffset, Length, RemoteRange, in this order (a wider stride leaves the rest unread).
constexpr size_t kBatchFields = 7;
constexpr size_t kSpanFields = 3;
// Decode range `i` of `at` (`stride` >= kBatchFields numbers per range) and check it against
// the tables: every value a non-negative safe integer, indices inside the tables, length >= 1,
// its remote range inside the remote's spans, the span itself (read once) inside the data of
// its segment (never the header), and both sides inside their bounds (the local buffer's
// length, the span's limit: the granted range, not the region). Overflow-safe. False with
// `f` set otherwise. `in.ranges` and `in.count` are not used.
bool DecodeBatchRange(const double* at, size_t stride, size_t i, const BatchInput& in, BatchRange* out, BatchFailure* f);
// Check the tables themselves: each remote's grant index inside the tables and its spans
// inside the span table; each seqlocked segment a valid host pool slot header; each grant
// with a token, and each record inside the records of a valid grant table.
bool CheckBatchTables(const BatchInput& in, BatchFailure* f);
// One read of the double at `p` (which another thread may be writing), for the tables.
double BatchLoadOnce(const double* p);
// Date.now() in the addon (CLOCK_REALTIME milliseconds): what BatchInput::deadline_ms is against.
double BatchNowMs();
// Run a validated batch: enter every grant once (in-flight counter++, state, generation and
// token checked, seq_cst; on a failure the grants entered so far are left and nothing is
// copied), copy every range, leave every grant. A read of a seqlocked segment copies all of
// that segment's ranges under one seqlock read (acquire load of the generation, copies,
// acquire fence, re-load) and retries all of them when a write overlapped, at most
// `max_attempts` times (then kRemoteRejected / "slot-rewritten"); `generations[s]` is the
// generation segment s was copied at (0 for segments without a seqlock). `order` is scratch.
bool RunBatch(const BatchInput& in, std::vector<uint32_t>* order, uint64_t* generations, BatchFailure* f);

// Owner's write: validate against the owner's capacity, take the seqlock, copy, publish.
Status SeqWrite(uint8_t* base, size_t size, uint64_t owner_capacity, const uint8_t* src, size_t len,
                uint32_t dtype, const std::vector<uint64_t>& shape, uint64_t* generation_out);
// Reader's re-check: true when no write started or finished since `generation` was observed
// (acquire fence after the caller's reads of the data, then a relaxed load).
bool SeqCheck(const uint8_t* base, size_t size, uint64_t generation);

Status SetState(uint8_t* base, size_t size, uint32_t state);
uint32_t LoadState(const uint8_t* base, size_t size);
// Importer count: increment then check live (seq_cst on both sides, pairs with the owner's
// free: store dead then load importers). Returns false (and undoes) when not live.
Status ImporterAdd(uint8_t* base, size_t size, bool* live);
Status ImporterRemove(uint8_t* base, size_t size, uint32_t* remaining);
uint32_t LoadImporters(const uint8_t* base, size_t size);

// Grants: enter = active++ then check live and token (seq_cst), leave = active--.
// Revoke = state dead + token zeroed (seq_cst); the owner then waits for active == 0.
enum GrantResult { kGrantOk = 0, kGrantRevoked = 1, kGrantBadToken = 2, kGrantNotGrant = 3 };
GrantResult GrantEnter(uint8_t* base, size_t size, const uint8_t* token, size_t token_len);
void GrantLeave(uint8_t* base, size_t size);
uint32_t GrantActive(const uint8_t* base, size_t size);
Status GrantRevoke(uint8_t* base, size_t size);

// Range-grant records of a grant table (kind kKindTable, see layout.h). `offset` is the
// record's byte offset in the table mapping; every call checks the table's header and
// geometry against `size` (the mapping length) and that `offset` is a record of it.
// Enter = active++, then state live, generation == `generation` and token checked (seq_cst;
// pairs with RecordRevoke as GrantEnter does with GrantRevoke); any mismatch backs out.
struct TableGeometry {
  uint64_t records = 0;
  uint64_t dir = 0;
  uint64_t arena = 0;
};
Status CheckTable(const uint8_t* base, size_t size, TableGeometry* out);
GrantResult RecordEnter(uint8_t* base, size_t size, uint64_t offset, uint64_t generation, const uint8_t* token, size_t token_len);
void RecordLeave(uint8_t* base, size_t size, uint64_t offset);
uint32_t RecordActive(const uint8_t* base, size_t size, uint64_t offset);
// Owner: the record's token, range table and count are written; store `generation`, then
// publish the record live (seq_cst).
Status RecordPublish(uint8_t* base, size_t size, uint64_t offset, uint64_t generation);
// Owner: state revoked (seq_cst), token zeroed, generation = `next_generation`; *active_out
// is the in-flight count seen after (the owner waits for 0 before RecordFree).
Status RecordRevoke(uint8_t* base, size_t size, uint64_t offset, uint64_t next_generation, uint32_t* active_out);
Status RecordFree(uint8_t* base, size_t size, uint64_t offset);
// Owner, before publishing a record: check a grant's ranges and write its range table at
// `arena_offset` of the table's arena, in one pass. `ranges`: `count` ranges of 3 doubles
// (registration index, offset, length); `regs`: `nregs` registrations of 3 doubles (directory
// index, base of the registration in its segment mapping, byte length). A range must name a
// registration, be a non-empty integer range and lie inside it. Returns the sum of the lengths,
// or -(k + 1) for the first bad range k (what was written before it is garbage, unpublished).
// Fails (kInvalidInput) when the mapping is not a grant table or the table does not fit its arena.
Status WriteRangeTable(uint8_t* base, size_t size, uint64_t arena_offset, const double* ranges, size_t count, const double* regs, size_t nregs, double* result);

}  // namespace tw
