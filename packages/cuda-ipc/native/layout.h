// Segment header layout shared by every tensorwire shared-memory segment.
//
// All integers are host-endian (segments never leave the host). The header occupies
// the first kHeaderSize bytes; host data (pool slots) starts at kDataOffset.
//
//   off  size  field
//     0     8  magic            "TWSEG\0\0\1" — release-stored last by the creator
//     8     4  version          1
//    12     4  kind             1 pool slot, 2 grant, 3 node presence, 4 grant table
//    16     4  header_size      4096
//    20     4  reserved
//    24     8  data_offset      4096 (pool host slots), 0 otherwise
//    32     8  capacity         bytes of the slot (host: segment size - data_offset)
//    40     4  owner_pid
//    44     4  device           -1 host, N = cuda:N
//    48     8  owner_start      owner's start time (/proc/<pid>/stat field 22), pid-reuse guard
//    56     8  ipc_offset       offset of the data inside its CUDA allocation
//    64    64  ipc_handle       CUipcMemHandle
//   128     8  generation       seqlock (atomic): odd while a write is in progress
//   136     4  state            (atomic) 0 initialising, 1 live, 2 freed / revoked / closed
//   140     4  importers        (atomic) processes holding an imported CUDA IPC handle
//   144     4  active           (atomic) grant: copies in flight
//   192     8  byte_length      } seqlock-protected tensor metadata
//   200     4  dtype            }
//   204     4  ndim             }
//   208    64  shape[8]         }
//   320     1  id_length
//   321   255  id               whole owner-namespaced id (pool / grant / node)
//  1024  3072  ext              kind-specific, immutable once state is live
//
// A grant table (kind 4) holds range grants (register once, grant per lease): after the
// header come `records` fixed-size records, `dir` directory entries (the data segments its
// grants' ranges lie in) and an arena of `arena` bytes holding each grant's range table.
// Its ext holds the three counts; a reader checks that header + records + directory +
// arena is exactly the mapping size it learned from fstat before using any of them.
//
//   record (64 bytes)            directory entry (256 bytes)   range entry (24 bytes, arena)
//     0  4 state (atomic)          0  4 state (1 live)           0  4 directory index
//     4  4 active (atomic)         4  4 flags (1 seqlocked)      8  8 offset in the segment
//     8  8 generation (atomic)     8  8 data bytes                     mapping (>= 4096)
//    16 16 token                  16  1 name length             16  8 length
//    32  8 arena offset           17 200 segment name
//    40  4 range count
//    44  4 form (0 ranges, 1 blocks: one range entry, then u32 block indices)
#pragma once
#include <cstddef>
#include <cstdint>

namespace tw {

constexpr uint64_t kMagic = 0x5457534547000001ull;  // "TWSEG" + format 1
constexpr uint32_t kVersion = 1;
constexpr uint32_t kHeaderSize = 4096;
constexpr uint64_t kDataOffset = 4096;
constexpr uint32_t kMaxNdim = 8;
constexpr uint32_t kMaxDtype = 13;
constexpr size_t kMaxIdLength = 255;
constexpr size_t kMaxNameLength = 200;
constexpr uint64_t kMaxSegmentBytes = 1ull << 40;  // 1 TiB hard cap

enum Kind : uint32_t { kKindPool = 1, kKindGrant = 2, kKindNode = 3, kKindTable = 4 };
enum State : uint32_t { kStateInit = 0, kStateLive = 1, kStateDead = 2 };

namespace off {
constexpr size_t magic = 0;
constexpr size_t version = 8;
constexpr size_t kind = 12;
constexpr size_t header_size = 16;
constexpr size_t data_offset = 24;
constexpr size_t capacity = 32;
constexpr size_t owner_pid = 40;
constexpr size_t device = 44;
constexpr size_t owner_start = 48;
constexpr size_t ipc_offset = 56;
constexpr size_t ipc_handle = 64;
constexpr size_t generation = 128;
constexpr size_t state = 136;
constexpr size_t importers = 140;
constexpr size_t active = 144;
constexpr size_t byte_length = 192;
constexpr size_t dtype = 200;
constexpr size_t ndim = 204;
constexpr size_t shape = 208;
constexpr size_t id_length = 320;
constexpr size_t id = 321;
constexpr size_t ext = 1024;
// grant ext
constexpr size_t grant_token = ext + 0;        // 16 bytes
constexpr size_t grant_target = ext + 16;      // u32: 0 host segment, 1 cuda
constexpr size_t grant_offset = ext + 24;      // u64 offset in the target segment / allocation
constexpr size_t grant_length = ext + 32;      // u64
constexpr size_t grant_name_len = ext + 40;    // u8
constexpr size_t grant_name = ext + 41;        // up to 200 bytes: host data segment name
// ext + 248: u32 flags; ext + 256: u64 owner's device pointer (CUDA); ext + 264: 16-byte owner
// process id (CUDA): read and written by the TypeScript side only.
// grant table ext
constexpr size_t table_records = ext + 0;      // u32 records
constexpr size_t table_dir = ext + 4;          // u32 directory entries
constexpr size_t table_arena = ext + 8;        // u64 arena bytes
}  // namespace off

// A range-grant record of a grant table.
constexpr size_t kRecordBytes = 64;
namespace rec {
constexpr size_t state = 0;         // u32 (atomic): kRecordFree, kRecordLive, kRecordRevoked
constexpr size_t active = 4;        // u32 (atomic): batches of peers inside the grant
constexpr size_t generation = 8;    // u64 (atomic): changes whenever the record is revoked
constexpr size_t token = 16;        // 16 bytes, zeroed on revoke
constexpr size_t arena_offset = 32; // u64: the range table, from the start of the arena
constexpr size_t count = 40;        // u32: ranges
constexpr size_t form = 44;         // u32: kFormRanges or kFormBlocks (how the arena table reads)
}  // namespace rec
// How a record's table in the arena reads. Ranges: `count` range entries. Blocks (a block grant:
// blocks of one size in one segment, named by index): one range entry (directory index, offset
// of block 0 in the segment mapping, block bytes) then `count` u32 block indices; range k is
// block indices[k], at offset + indices[k] * block bytes.
enum RecordForm : uint32_t { kFormRanges = 0, kFormBlocks = 1 };
enum RecordState : uint32_t { kRecordFree = 0, kRecordLive = 1, kRecordRevoked = 2 };
constexpr size_t kDirEntryBytes = 256;
constexpr size_t kRangeEntryBytes = 24;
// Upper bounds a reader accepts for a table's geometry (the owner's defaults are far below).
constexpr uint64_t kMaxTableRecords = 1ull << 20;
constexpr uint64_t kMaxTableDir = 1ull << 18;
constexpr uint64_t kMaxTableArena = 1ull << 32;

constexpr size_t kTokenBytes = 16;
constexpr size_t kIpcHandleBytes = 64;

}  // namespace tw
