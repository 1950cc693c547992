/**
 * The tensor pool: one per node (owner). The owner registers slots, writes into them and
 * frees them; any process on the host reads a slot by its pool id as a zero-copy view.
 *
 * Invariant 1: every table is keyed by the whole pool id (`pool:<owner>:<n>`), and a free
 * by a non-owner releases only the caller's own mappings and imported handles.
 * Invariant 9: the owner's free of a CUDA slot is deferred until importers have closed.
 * Invariant 10: segments are 0600, exclusive-create, unlinked on free and at exit, and
 * their headers are validated against sizes learned from fstat / the owner.
 */
import {
  ClosedError,
  IdAllocator,
  IdRegistry,
  InvalidInputError,
  ResourceExhaustedError,
  TensorwireError,
  assertOwner,
  errorFromSignal,
  parseId,
  silentLogger,
  type Logger,
} from '@tensorwire/core';
import { DTYPES, assertDtype, dtypeFromCode, shapeBytes, typedView, type Dtype, type TypedArrayFor } from './dtype.js';
import { native, SegmentKind, SegmentState, type SegmentMeta } from './native.js';
import { poolSegmentName } from './names.js';
import { isProcessAlive, selfStartTime } from './proc.js';
import { DATA_OFFSET, HEADER_SIZE, MAX_SEGMENT_BYTES, hookExit, rememberRegion, segmentOlderThan, sweep, type SweepReport } from './shared.js';

export type Device = 'cpu' | `cuda:${number}`;

export interface PoolOptions {
  /** This node's name: the owner part of every pool id it creates (`[A-Za-z0-9_-]`, 1-64). */
  readonly owner: string;
  /** Largest slot this pool creates or maps (default 16 GiB). */
  readonly maxSlotBytes?: number;
  /** How long the owner's free of a CUDA slot waits for importers before freeing anyway (default 30 s). */
  readonly deferredFreeTimeoutMs?: number;
  readonly logger?: Logger;
}

export interface SlotSpec {
  /** Element type (default uint8). */
  readonly dtype?: Dtype;
  /** Tensor shape; each dimension a positive integer. Give this or `byteLength`. */
  readonly shape?: readonly number[];
  /** Byte size (a 1-D tensor of `byteLength / itemsize` elements). */
  readonly byteLength?: number;
  /** Where the slot lives (default 'cpu'). */
  readonly device?: Device;
}

export interface WriteOptions {
  /** Element type of this write (default: the slot's). */
  readonly dtype?: Dtype;
  /** Shape of this write (default: the slot's when the sizes match, else 1-D). */
  readonly shape?: readonly number[];
}

export interface ReadOptions {
  readonly signal?: AbortSignal;
}

export interface FreeResult {
  /**
   * The owner's free: true when a CUDA slot's device memory is still held for importers.
   * Anyone else's free: true when views of the slot are still live in this process, so its
   * mapping (and CUDA import) goes only when the last of them is disposed.
   */
  readonly deferred: boolean;
  /**
   * Settles when what `deferred` waits for has been released: the owner's device memory
   * (at once for host slots), or this process's mapping and import of another owner's slot.
   */
  readonly released: Promise<void>;
}

/** What a slot holds, as seen by a reader. */
export interface PoolViewInfo {
  readonly id: string;
  readonly dtype: Dtype;
  readonly shape: readonly number[];
  readonly byteLength: number;
  readonly device: Device;
  /** Seqlock generation the view was taken at. */
  readonly generation: bigint;
}

const DEFAULT_MAX_SLOT = 16 * 2 ** 30;

/** Indices into the Float64Array that native.viewMeta fills. */
const VM_STATE = 0;
const VM_DEVICE = 1;
const VM_BYTE_LENGTH = 2;
// index 3: capacity (unused here)
const VM_DTYPE = 4;
const VM_NDIM = 5;
const VM_SHAPE = 6;

interface OwnedSlot {
  readonly id: string;
  readonly name: string;
  readonly mapping: ArrayBuffer;
  readonly capacity: number;
  readonly device: number;
  readonly dtype: Dtype;
  /** DTYPES[dtype].code, kept for the write hot path. */
  readonly dtypeCode: number;
  readonly shape: readonly number[];
  readonly devicePointer: bigint | undefined;
}

/**
 * A mapping of another owner's slot held by this process (plus its CUDA import).
 *
 * Lifecycle of the import (invariant 9): the header's importer count is taken before
 * cuIpcOpenMemHandle and given back only after cuIpcCloseMemHandle, and that happens only
 * once the entry is `dropped` (this process's free(), close(), or the slot found freed),
 * no view of it is live (`views`), and no import is in flight (`importing`). An entry
 * dropped while views are live waits in `#retired` until the last view is disposed.
 */
interface ForeignMapping {
  readonly id: string;
  readonly mapping: ArrayBuffer;
  views: number;
  imported: { device: number; base: bigint } | undefined;
  importing: Promise<bigint> | undefined;
  dropped: boolean;
  /** Settles once this process has closed its import (if any) and given back its importer count. */
  released: Promise<void> | undefined;
  resolveReleased: (() => void) | undefined;
}

/** How long an existing segment may stay undecodable (its creator still initialising it) before it counts as stale. */
const STALE_INIT_GRACE_MS = 5_000;

function parseDevice(device: unknown): number {
  if (device === undefined || device === 'cpu') return -1;
  if (typeof device === 'string') {
    const m = /^cuda:(\d{1,4})$/.exec(device);
    if (m) {
      const n = Number(m[1]);
      if (n <= 1023) return n;
    }
  }
  throw new InvalidInputError(`device ${JSON.stringify(device)} must be 'cpu' or 'cuda:N'`, { details: { field: 'device' } });
}

function deviceName(device: number): Device {
  return device < 0 ? 'cpu' : `cuda:${device}`;
}

function toBytes(data: unknown, what: string): Uint8Array {
  if (data instanceof Uint8Array) return data;
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  if (data instanceof ArrayBuffer || (typeof SharedArrayBuffer !== 'undefined' && data instanceof SharedArrayBuffer)) return new Uint8Array(data);
  throw new InvalidInputError(`${what} must be an ArrayBuffer or a typed array`, { details: { field: what } });
}

/** A zero-copy view of a slot. Dispose it when done; the memory stays mapped while any of its arrays is reachable. */
export class PoolView implements PoolViewInfo, Disposable {
  readonly id: string;
  readonly dtype: Dtype;
  readonly shape: readonly number[];
  readonly byteLength: number;
  readonly device: Device;
  readonly generation: bigint;
  readonly #mapping: ArrayBuffer;
  readonly #buffer: Uint8Array | undefined;
  readonly #pointer: bigint | undefined;
  readonly #onDispose: () => void;
  #disposed = false;

  /** @internal */
  constructor(info: PoolViewInfo, mapping: ArrayBuffer, buffer: Uint8Array | undefined, pointer: bigint | undefined, onDispose: () => void) {
    this.id = info.id;
    this.dtype = info.dtype;
    this.shape = Object.freeze([...info.shape]);
    this.byteLength = info.byteLength;
    this.device = info.device;
    this.generation = info.generation;
    this.#mapping = mapping;
    this.#buffer = buffer;
    this.#pointer = pointer;
    this.#onDispose = onDispose;
  }

  get disposed(): boolean {
    return this.#disposed;
  }

  #assertLive(): void {
    if (this.#disposed) throw new ClosedError(`view of ${this.id} was disposed`);
  }

  /** The bytes of a host slot (zero copy), undefined for CUDA slots. */
  get buffer(): Uint8Array | undefined {
    this.#assertLive();
    return this.#buffer;
  }

  /** The device address of a CUDA slot in this process, undefined for host slots. */
  get devicePointer(): bigint | undefined {
    this.#assertLive();
    return this.#pointer;
  }

  /** A typed array of the slot's dtype over the same bytes (host slots). */
  array(): TypedArrayFor {
    this.#assertLive();
    if (!this.#buffer) throw new InvalidInputError(`${this.id} is a ${this.device} slot; it has no host array`);
    return typedView(this.dtype, this.#buffer.buffer, this.#buffer.byteOffset, this.#buffer.byteLength);
  }

  /**
   * The seqlock re-check: true when no write started since this view was taken and the
   * slot is still live, so everything read from the view so far is one consistent tensor.
   * Call it after reading (a reader that needs consistency re-reads when it returns false).
   */
  isConsistent(): boolean {
    if (this.#disposed) return false;
    return native.seqCheck(this.#mapping, this.generation);
  }

  /** Idempotent. */
  dispose(): void {
    if (this.#disposed) return;
    this.#disposed = true;
    this.#onDispose();
  }

  [Symbol.dispose](): void {
    this.dispose();
  }
}

/**
 * A node's tensor pool. `register` → pool id; `write`; `read` (any process on the host);
 * `free`; `close`. See the package README.
 */
export class TensorPool implements AsyncDisposable {
  readonly owner: string;
  readonly maxSlotBytes: number;
  readonly #ids: IdAllocator;
  readonly #owned = new IdRegistry<OwnedSlot, 'pool'>('pool');
  readonly #foreign = new IdRegistry<ForeignMapping, 'pool'>('pool');
  /** Dropped foreign entries whose import waits for live views, keyed by the whole pool id. */
  readonly #retired = new Map<string, ForeignMapping>();
  readonly #pendingFrees = new Set<Promise<void>>();
  readonly #freed = new Set<string>();
  readonly #deferredFreeTimeoutMs: number;
  readonly #logger: Logger;
  #closed: Promise<void> | undefined;
  /** Scratch for native.viewMeta (readSync's header read), see the VM_* indices. */
  readonly #viewMeta = new Float64Array(VM_SHAPE + 8);
  /** The slot of the last write (cleared when that slot is freed or the pool closes). */
  #lastWritten: OwnedSlot | undefined;

  constructor(options: PoolOptions) {
    if (typeof options !== 'object' || options === null) throw new InvalidInputError('options must be an object');
    assertOwner(options.owner);
    const max = options.maxSlotBytes ?? DEFAULT_MAX_SLOT;
    if (!Number.isSafeInteger(max) || max < 1 || max > MAX_SEGMENT_BYTES - DATA_OFFSET) {
      throw new InvalidInputError(`maxSlotBytes ${String(max)} must be an integer between 1 and ${MAX_SEGMENT_BYTES - DATA_OFFSET}`, {
        details: { field: 'maxSlotBytes' },
      });
    }
    this.owner = options.owner;
    this.maxSlotBytes = max;
    this.#ids = new IdAllocator(options.owner);
    this.#deferredFreeTimeoutMs = options.deferredFreeTimeoutMs ?? 30_000;
    this.#logger = options.logger ?? silentLogger;
    native.layout(); // fail fast (BackendUnavailableError) when the addon is missing
    hookExit();
  }

  get closed(): boolean {
    return this.#closed !== undefined;
  }

  #assertOpen(): void {
    if (this.#closed) throw new ClosedError(`pool ${this.owner} is closed`);
  }

  /** Create a slot and return its pool id, `pool:<owner>:<n>`. */
  async register(spec: SlotSpec): Promise<string> {
    this.#assertOpen();
    if (typeof spec !== 'object' || spec === null) throw new InvalidInputError('slot spec must be an object', { details: { field: 'spec' } });
    const dtype = spec.dtype ?? 'uint8';
    assertDtype(dtype);
    const item = DTYPES[dtype].size;
    let shape: readonly number[];
    let bytes: number;
    if (spec.shape !== undefined) {
      bytes = shapeBytes(spec.shape, dtype, this.maxSlotBytes);
      shape = [...spec.shape];
      if (spec.byteLength !== undefined && spec.byteLength !== bytes) {
        throw new InvalidInputError(`byteLength ${String(spec.byteLength)} does not match shape [${shape.join(', ')}] of ${dtype} (${bytes} bytes)`, {
          details: { field: 'byteLength' },
        });
      }
    } else {
      const b = spec.byteLength;
      if (typeof b !== 'number' || !Number.isSafeInteger(b) || b < 1) {
        throw new InvalidInputError(`byteLength ${String(b)} must be a positive integer (or give a shape)`, { details: { field: 'byteLength' } });
      }
      if (b > this.maxSlotBytes) {
        throw new InvalidInputError(`byteLength ${b} exceeds the slot limit of ${this.maxSlotBytes} bytes`, { details: { field: 'byteLength' } });
      }
      if (b % item !== 0) throw new InvalidInputError(`byteLength ${b} is not a multiple of ${dtype}'s ${item} bytes`, { details: { field: 'byteLength' } });
      bytes = b;
      shape = [b / item];
    }
    const device = parseDevice(spec.device);
    const id = this.#ids.next('pool');
    const name = poolSegmentName(id);
    if (device < 0) {
      const mapping = this.#create(name, DATA_OFFSET + bytes, {
        kind: SegmentKind.Pool,
        id,
        dataOffset: DATA_OFFSET,
        capacity: bytes,
        ownerPid: process.pid,
        ownerStart: selfStartTime(),
        device: -1,
        byteLength: bytes,
        dtype: DTYPES[dtype].code,
        shape,
      });
      native.setState(mapping, SegmentState.Live);
      rememberRegion(mapping, { name, dataOffset: DATA_OFFSET, dataBytes: bytes, seqlocked: true });
      this.#owned.set(id, { id, name, mapping, capacity: bytes, device, dtype, dtypeCode: DTYPES[dtype].code, shape, devicePointer: undefined });
      return id;
    }
    const pointer = await native.cudaAlloc(device, bytes);
    try {
      const exp = await native.cudaExport(device, pointer);
      this.#assertOpen();
      const mapping = this.#create(name, HEADER_SIZE, {
        kind: SegmentKind.Pool,
        id,
        dataOffset: 0,
        capacity: bytes,
        ownerPid: process.pid,
        ownerStart: selfStartTime(),
        device,
        ipcHandle: exp.handle,
        ipcOffset: exp.offset,
        byteLength: bytes,
        dtype: DTYPES[dtype].code,
        shape,
      });
      native.setState(mapping, SegmentState.Live);
      this.#owned.set(id, { id, name, mapping, capacity: bytes, device, dtype, dtypeCode: DTYPES[dtype].code, shape, devicePointer: pointer });
      return id;
    } catch (e) {
      await native.cudaFree(device, pointer).catch(() => undefined);
      throw e;
    }
  }

  /** Exclusive create; a leftover segment of a dead owner with the same name is swept first. */
  #create(name: string, size: number, init: Parameters<typeof native.shmCreate>[2]): ArrayBuffer {
    try {
      return native.shmCreate(name, size, init);
    } catch (e) {
      if (!(e instanceof ResourceExhaustedError) || e.details['errnoName'] !== 'EEXIST') throw e;
      // The locator names the creator; a dead creator's memfd is gone, so only the name is left.
      let owner: { ownerPid: number; ownerStart: bigint } | undefined;
      let problem = '';
      try {
        const loc = native.shmLocate(name);
        owner = { ownerPid: loc.pid, ownerStart: loc.ownerStart };
      } catch (err) {
        owner = undefined;
        problem = err instanceof Error ? err.message : String(err);
      }
      if (owner && isProcessAlive(owner.ownerPid, owner.ownerStart)) {
        throw new ResourceExhaustedError(
          `segment ${name} already exists and belongs to live pid ${owner.ownerPid}: is another pool named ${JSON.stringify(this.owner)} running on this host?`,
          { details: { field: 'owner', pid: owner.ownerPid } },
        );
      }
      // An undecodable header is stale only once it is old: until then another process may
      // still be creating it (the magic is stored last), and removing it would break that one.
      if (!owner && !segmentOlderThan(name, STALE_INIT_GRACE_MS)) {
        throw new ResourceExhaustedError(
          `segment ${name} already exists and its header is not valid yet (${problem}): another process may be creating it; is another pool named ${JSON.stringify(this.owner)} starting on this host?`,
          { details: { field: 'owner', name } },
        );
      }
      this.#logger.warn('removing a stale segment', { name, pid: owner?.ownerPid, reason: owner ? 'owner is dead' : `header invalid for over ${STALE_INIT_GRACE_MS} ms: ${problem}` });
      native.shmUnlink(name);
      return native.shmCreate(name, size, init);
    }
  }

  #ownedSlot(id: string, op: string): OwnedSlot {
    const parsed = parseId(id, 'pool');
    if (parsed.owner !== this.owner) {
      throw new InvalidInputError(`cannot ${op} ${id}: it belongs to ${parsed.owner}, and only its owner (not ${this.owner}) may ${op} it`, {
        details: { field: 'id', owner: parsed.owner },
      });
    }
    const slot = this.#owned.get(id);
    if (!slot) {
      if (this.#freed.has(id)) throw new ClosedError(`pool ${id} was freed`, { details: { field: 'id' } });
      throw new InvalidInputError(`pool ${id} is not registered in this pool`, { details: { field: 'id' } });
    }
    return slot;
  }

  #writeShape(slot: OwnedSlot, len: number, options: WriteOptions): { dtype: Dtype; shape: readonly number[] } {
    const dtype = options.dtype ?? slot.dtype;
    assertDtype(dtype);
    const item = DTYPES[dtype].size;
    if (len === 0) throw new InvalidInputError('write of 0 bytes', { details: { field: 'data' } });
    if (len > slot.capacity) {
      throw new InvalidInputError(`write of ${len} bytes exceeds the slot capacity of ${slot.capacity} bytes (${slot.id})`, { details: { field: 'data' } });
    }
    if (options.shape !== undefined) {
      const b = shapeBytes(options.shape, dtype, slot.capacity);
      if (b !== len) throw new InvalidInputError(`shape [${options.shape.join(', ')}] of ${dtype} is ${b} bytes but the data is ${len}`, { details: { field: 'shape' } });
      return { dtype, shape: [...options.shape] };
    }
    if (dtype === slot.dtype && len === slot.capacity) return { dtype, shape: slot.shape };
    if (len % item !== 0) throw new InvalidInputError(`write of ${len} bytes is not a multiple of ${dtype}'s ${item} bytes`, { details: { field: 'data' } });
    return { dtype, shape: [len / item] };
  }

  /**
   * The owned slot `id` for a write. The hot path (the slot written last, or any slot in
   * the registry, which holds only this owner's whole ids) skips re-parsing the id; a miss
   * goes through {@link #ownedSlot}, which names what is wrong (foreign owner, freed, unknown).
   */
  #slotForWrite(id: string): OwnedSlot {
    const last = this.#lastWritten;
    if (last !== undefined && last.id === id) return last;
    const slot = this.#owned.get(id) ?? this.#ownedSlot(id, 'write');
    this.#lastWritten = slot;
    return slot;
  }

  /** Write into a host slot (owner only), under the seqlock. Returns the new generation. */
  writeSync(id: string, data: ArrayBufferView | ArrayBufferLike, options?: WriteOptions): bigint {
    this.#assertOpen();
    const slot = this.#slotForWrite(id);
    if (slot.device >= 0) throw new InvalidInputError(`${id} is a ${deviceName(slot.device)} slot: use write()`, { details: { field: 'id' } });
    const bytes = toBytes(data, 'data');
    if (options === undefined && bytes.byteLength === slot.capacity) {
      // The whole slot with its registered dtype and shape: nothing to re-derive.
      return native.seqWrite(slot.mapping, slot.capacity, bytes, slot.dtypeCode, slot.shape);
    }
    const { dtype, shape } = this.#writeShape(slot, bytes.byteLength, options ?? {});
    return native.seqWrite(slot.mapping, slot.capacity, bytes, DTYPES[dtype].code, shape);
  }

  /**
   * Write into a slot (owner only). Host slots: a seqlocked copy. CUDA slots: the data
   * (host bytes, or `{ devicePointer }` on the slot's device) must fill the slot exactly.
   */
  async write(id: string, data: ArrayBufferView | ArrayBufferLike | { readonly devicePointer: bigint }, options: WriteOptions = {}): Promise<void> {
    this.#assertOpen();
    const slot = this.#ownedSlot(id, 'write');
    if (slot.device < 0) {
      if (typeof data === 'object' && data !== null && 'devicePointer' in data) {
        throw new InvalidInputError(`${id} is a host slot; write host bytes`, { details: { field: 'data' } });
      }
      this.writeSync(id, data, options);
      return;
    }
    const pointer = slot.devicePointer as bigint;
    if (typeof data === 'object' && data !== null && 'devicePointer' in data) {
      if (typeof data.devicePointer !== 'bigint' || data.devicePointer <= 0n) {
        throw new InvalidInputError('devicePointer must be a positive bigint', { details: { field: 'data' } });
      }
      await native.cudaCopy('d2d', slot.device, pointer, data.devicePointer, slot.capacity);
      return;
    }
    const bytes = toBytes(data, 'data');
    if (bytes.byteLength !== slot.capacity) {
      throw new InvalidInputError(`a ${deviceName(slot.device)} slot is written whole: got ${bytes.byteLength} bytes, slot holds ${slot.capacity}`, {
        details: { field: 'data' },
      });
    }
    await native.cudaCopy('h2d', slot.device, pointer, bytes, bytes.byteLength);
  }

  /** The mapping of `id` (own slot, cached foreign mapping, or a fresh one). */
  #mappingFor(id: string): { mapping: ArrayBuffer; foreign: ForeignMapping | undefined } {
    const parsed = parseId(id, 'pool');
    if (parsed.owner === this.owner) {
      return { mapping: this.#ownedSlot(id, 'read').mapping, foreign: undefined };
    }
    let f = this.#foreign.get(id);
    if (f && native.loadState(f.mapping) !== SegmentState.Live) {
      void this.#dropForeign(f);
      f = undefined;
    }
    if (!f) {
      // An entry this process dropped (free()) while views of it were live: take it back
      // instead of importing the same CUDA IPC handle a second time.
      const r = this.#retired.get(id);
      if (r && native.loadState(r.mapping) === SegmentState.Live) {
        this.#retired.delete(id);
        r.dropped = false;
        this.#foreign.set(id, r);
        return { mapping: r.mapping, foreign: r };
      }

      let mapping: ArrayBuffer;
      try {
        mapping = native.shmOpen(poolSegmentName(id), DATA_OFFSET + this.maxSlotBytes);
      } catch (e) {
        if (e instanceof TensorwireError && e.details['errnoName'] === 'ENOENT') {
          throw new ClosedError(`pool ${id} does not exist (freed, or its owner exited)`, { cause: e, details: { field: 'id' } });
        }
        throw e;
      }
      f = { id, mapping, views: 0, imported: undefined, importing: undefined, dropped: false, released: undefined, resolveReleased: undefined };
      this.#foreign.set(id, f);
    }
    return { mapping: f.mapping, foreign: f };
  }

  #decode(id: string, mapping: ArrayBuffer): SegmentMeta {
    const meta = native.headerDecode(mapping, SegmentKind.Pool, id);
    if (meta.state !== SegmentState.Live) throw new ClosedError(`pool ${id} was freed by its owner`, { details: { field: 'id' } });
    return meta;
  }

  #info(id: string, meta: SegmentMeta): PoolViewInfo {
    return { id, dtype: dtypeFromCode(meta.dtype), shape: meta.shape, byteLength: meta.byteLength, device: deviceName(meta.device), generation: meta.generation };
  }

  #viewRelease(foreign: ForeignMapping | undefined): () => void {
    if (!foreign) return () => undefined;
    foreign.views++;
    return () => {
      foreign.views = Math.max(0, foreign.views - 1);
      if (foreign.views > 0) return;
      if (foreign.dropped) {
        void this.#settle(foreign);
      } else if (foreign.imported && native.loadState(foreign.mapping) !== SegmentState.Live) {
        // The owner freed the slot and waits for importers: the last view gives ours back now.
        void this.#dropForeign(foreign);
      }
    };
  }

  /** Open a host slot as a zero-copy view (any process on the host). */
  readSync(id: string): PoolView {
    this.#assertOpen();
    const { mapping, foreign } = this.#mappingFor(id);
    // Same validation and seqlock read as #decode, without building a full metadata object.
    const m = this.#viewMeta;
    const generation = native.viewMeta(mapping, id, m);
    if (m[VM_STATE] !== SegmentState.Live) throw new ClosedError(`pool ${id} was freed by its owner`, { details: { field: 'id' } });
    const device = m[VM_DEVICE] as number;
    if (device >= 0) throw new InvalidInputError(`${id} is a ${deviceName(device)} slot: use read()`, { details: { field: 'id' } });
    const byteLength = m[VM_BYTE_LENGTH] as number;
    const ndim = m[VM_NDIM] as number;
    const shape: number[] = [];
    for (let i = 0; i < ndim; i++) shape.push(m[VM_SHAPE + i] as number);
    // Sizes come from the validated header: dataOffset == 4096 and byteLength <= capacity == mapping size - 4096.
    const buffer = new Uint8Array(mapping, DATA_OFFSET, byteLength);
    // Not remembered as a grantable region: only the owner may grant its slots (invariant 13).
    const info: PoolViewInfo = { id, dtype: dtypeFromCode(m[VM_DTYPE] as number), shape, byteLength, device: 'cpu', generation };
    return new PoolView(info, mapping, buffer, undefined, this.#viewRelease(foreign));
  }

  /** Open a slot as a zero-copy view: host bytes, or an imported CUDA IPC pointer. */
  async read(id: string, options: ReadOptions = {}): Promise<PoolView> {
    this.#assertOpen();
    if (options.signal?.aborted) throw errorFromSignal(options.signal, `read ${id}`);
    const { mapping, foreign } = this.#mappingFor(id);
    const meta = this.#decode(id, mapping);
    if (meta.device < 0) return this.readSync(id);
    let pointer: bigint;
    if (!foreign) {
      pointer = this.#ownedSlot(id, 'read').devicePointer as bigint;
    } else {
      pointer = (await this.#import(foreign, meta)) + BigInt(meta.ipcOffset);
    }
    if (options.signal?.aborted) throw errorFromSignal(options.signal, `read ${id}`);
    return new PoolView(this.#info(id, meta), mapping, undefined, pointer, this.#viewRelease(foreign));
  }

  /**
   * Import the CUDA IPC handle once per whole pool id; counted in the header's importers.
   * If this process drops the entry (free(), close()) or the owner frees the slot while the
   * import is in flight, the import is closed again and the read fails with ClosedError.
   */
  async #import(f: ForeignMapping, meta: SegmentMeta): Promise<bigint> {
    if (!f.imported && !f.importing) {
      f.importing = (async () => {
        if (!native.importerAdd(f.mapping)) throw new ClosedError(`pool ${f.id} was freed by its owner`);
        let base: bigint;
        try {
          base = await native.cudaImport(meta.device, meta.ipcHandle);
        } catch (e) {
          native.importerRemove(f.mapping);
          throw e;
        }
        f.imported = { device: meta.device, base };
        return base;
      })().finally(() => {
        f.importing = undefined;
      });
    }
    const base = f.imported ? f.imported.base : await (f.importing as Promise<bigint>);
    if (f.dropped || this.#closed) {
      void this.#settle(f);
      throw new ClosedError(`pool ${f.id} was released by this process (free() or close()) while it was being imported`, { details: { field: 'id' } });
    }
    if (native.loadState(f.mapping) !== SegmentState.Live) {
      if (f.views === 0) void this.#dropForeign(f);
      throw new ClosedError(`pool ${f.id} was freed by its owner`, { details: { field: 'id' } });
    }
    return base;
  }

  /**
   * Take `f` out of this process's mappings. Its import is closed (and the importer count
   * given back) now if no view of it is live and no import is in flight, else when the last
   * view is disposed / the import lands. Resolves when that has happened.
   */
  #dropForeign(f: ForeignMapping): Promise<void> {
    if (this.#foreign.get(f.id) === f) this.#foreign.delete(f.id);
    f.dropped = true;
    // Once per entry (an entry taken back from #retired keeps the promise free() handed out).
    f.released ??= new Promise<void>((resolve) => (f.resolveReleased = resolve));
    if (f.importing) {
      void f.importing.then(
        () => this.#settle(f),
        () => this.#settle(f),
      );
      return f.released as Promise<void>;
    }
    if (f.views > 0) {
      this.#retired.set(f.id, f);
      return f.released as Promise<void>;
    }
    return this.#settle(f);
  }

  /** Close a dropped entry's import once nothing uses it any more. Idempotent. */
  #settle(f: ForeignMapping): Promise<void> {
    const done = f.released ?? Promise.resolve();
    if (!f.dropped || f.importing) return done;
    if (f.views > 0) {
      this.#retired.set(f.id, f);
      return done;
    }
    if (this.#retired.get(f.id) === f) this.#retired.delete(f.id);
    const resolve = f.resolveReleased;
    if (!resolve) return done;
    f.resolveReleased = undefined;
    const imp = f.imported;
    f.imported = undefined;
    if (!imp) {
      resolve();
      return done;
    }
    void native
      .cudaCloseImport(imp.device, imp.base)
      .catch((e: unknown) => this.#logger.warn('cuIpcCloseMemHandle failed', { id: f.id, error: String(e) }))
      .finally(() => {
        try {
          native.importerRemove(f.mapping);
        } finally {
          resolve();
        }
      });
    return done;
  }

  /**
   * A consistent copy of a host slot (seqlock: copy, then re-check, retrying while a write
   * is in progress). Never returns a torn tensor.
   */
  snapshot(id: string, into?: Uint8Array): { info: PoolViewInfo; data: Uint8Array } {
    this.#assertOpen();
    const { mapping } = this.#mappingFor(id);
    const cap = mapping.byteLength - DATA_OFFSET;
    const dst = into ?? new Uint8Array(Math.max(0, cap));
    const meta = native.seqCopy(mapping, id, dst);
    return { info: this.#info(id, meta), data: dst.subarray(0, meta.byteLength) };
  }

  /**
   * Free a slot. The owner frees its own slot (unlinked now; views already open stay
   * mapped; a CUDA slot's device memory is released once importers close, or after the
   * timeout). Anyone else's free releases only this process's mapping and imported
   * handle of that pool id: at once when none of its views is live, else it returns at
   * once with `deferred: true` and the mapping goes when the last view is disposed
   * (`released` settles then; the views stay valid until then). It never waits for the
   * caller's own live views.
   */
  async free(id: string, options: { signal?: AbortSignal; forceAfterMs?: number } = {}): Promise<FreeResult> {
    const parsed = parseId(id, 'pool');
    if (parsed.owner !== this.owner) {
      const f = this.#foreign.get(id);
      if (!f) return { deferred: false, released: Promise.resolve() };
      const released = this.#dropForeign(f);
      // Live views (host or CUDA) keep the mapping and any import until the last is
      // disposed: say so at once instead of waiting for views this caller may itself hold.
      if (f.views > 0) return { deferred: true, released };
      await released;
      return { deferred: false, released };
    }
    this.#assertOpen();
    const slot = this.#ownedSlot(id, 'free');
    this.#owned.delete(id);
    if (this.#lastWritten === slot) this.#lastWritten = undefined;
    this.#freed.add(id);
    // Dead first (seq_cst), then unlink: importers that race with us see dead and back out.
    this.#markDead(slot);
    native.shmUnlink(slot.name);
    if (slot.device < 0) return { deferred: false, released: Promise.resolve() };
    const deferred = native.importers(slot.mapping) > 0;
    const released = this.#releaseDevice(slot, options.forceAfterMs ?? this.#deferredFreeTimeoutMs, options.signal);
    this.#pendingFrees.add(released);
    void released.finally(() => this.#pendingFrees.delete(released)).catch(() => undefined);
    return { deferred, released };
  }

  /** Mark a slot freed in its header; a tampered header must not stop the owner's free. */
  #markDead(slot: OwnedSlot): void {
    try {
      native.setState(slot.mapping, SegmentState.Dead);
    } catch (e) {
      this.#logger.warn('could not mark a slot freed (header damaged?); unlinking it anyway', { id: slot.id, error: String(e) });
    }
  }

  async #releaseDevice(slot: OwnedSlot, forceAfterMs: number, signal: AbortSignal | undefined): Promise<void> {
    const until = Date.now() + forceAfterMs;
    let delay = 1;
    while (native.importers(slot.mapping) > 0) {
      if (Date.now() >= until || signal?.aborted) {
        this.#logger.warn('freeing a cuda slot that importers still hold (deadline passed)', { id: slot.id, importers: native.importers(slot.mapping) });
        break;
      }
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 50);
    }
    await native.cudaFree(slot.device, slot.devicePointer as bigint);
  }

  /** Pool ids this pool owns and has not freed. */
  owned(): string[] {
    return [...this.#owned.keys()];
  }

  /** Pool ids of other owners this process has mapped. */
  mapped(): string[] {
    return [...this.#foreign.keys()];
  }

  /** Importer count of an owned CUDA slot (from its header). */
  importers(id: string): number {
    return native.importers(this.#ownedSlot(id, 'inspect').mapping);
  }

  /** Remove segments of dead owners on this host. */
  sweep(): SweepReport {
    return sweep();
  }

  /**
   * Free every owned slot (waiting for CUDA importers up to the timeout) and release every
   * mapping. Imports of other owners' CUDA slots that live views still use are closed when
   * the last of those views is disposed, not here (invariant 9). Idempotent.
   */
  close(): Promise<void> {
    this.#closed ??= (async () => {
      this.#lastWritten = undefined;
      const frees: Promise<void>[] = [];
      for (const id of [...this.#owned.keys()]) {
        const slot = this.#owned.get(id) as OwnedSlot;
        this.#owned.delete(id);
        this.#freed.add(id);
        this.#markDead(slot);
        native.shmUnlink(slot.name);
        if (slot.device >= 0) frees.push(this.#releaseDevice(slot, this.#deferredFreeTimeoutMs, undefined));
      }
      for (const f of [...this.#foreign.values()]) {
        const released = this.#dropForeign(f);
        // Waiting for views the application still holds could wait forever.
        if (f.views === 0) frees.push(released);
      }
      frees.push(...this.#pendingFrees);
      const results = await Promise.allSettled(frees);
      for (const r of results) if (r.status === 'rejected') this.#logger.warn('release failed during close', { error: String(r.reason) });
    })();
    return this.#closed;
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

