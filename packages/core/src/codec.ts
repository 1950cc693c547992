/**
 * A small bounds-checked binary codec for everything tensorwire puts on a wire or in a
 * descriptor. Every read checks the remaining length first and throws InvalidInputError
 * naming the field, so a decoder fed arbitrary bytes fails cleanly instead of reading
 * past the end or allocating what a peer claimed.
 */
import { InvalidInputError } from './errors.js';

const textEncoder = new TextEncoder();
const textDecoder = new TextDecoder('utf-8', { fatal: true });

/**
 * The buffer writers work in: one writer at a time borrows it from construction to finish(),
 * which copies its bytes out (so a descriptor costs one buffer, not a buffer, a grown one and a
 * copy). A writer made while it is out (nested encoders) allocates its own. A borrower that
 * never finishes (it threw) keeps it: after {@link SCRATCH_LOST_AFTER} writers in a row found it
 * out, a new one is made (a buffer is never in the pool while a writer uses it).
 */
const SCRATCH_BYTES = 4096;
const SCRATCH_LOST_AFTER = 32;
let scratch: Uint8Array | undefined = new Uint8Array(SCRATCH_BYTES);
let scratchView: DataView | undefined = new DataView(scratch.buffer);
let scratchMissed = 0;
/** A finished writer's buffer: any further write or finish() throws. */
const FINISHED = new Uint8Array(0);
const FINISHED_VIEW = new DataView(FINISHED.buffer);

/**
 * Big-endian fields and length-prefixed bytes and strings, into a buffer that grows. One use:
 * `finish()` returns a copy of what was written, after which the writer takes no more writes.
 */
export class ByteWriter {
  #buf: Uint8Array;
  #view: DataView;
  #pos = 0;
  #borrowed = false;
  constructor(initialCapacity = 64) {
    if (scratch === undefined && ++scratchMissed > SCRATCH_LOST_AFTER) {
      scratch = new Uint8Array(SCRATCH_BYTES);
      scratchView = new DataView(scratch.buffer);
    }
    if (scratch !== undefined && scratchView !== undefined && initialCapacity <= SCRATCH_BYTES) {
      this.#buf = scratch;
      this.#view = scratchView;
      this.#borrowed = true;
      scratch = undefined;
      scratchView = undefined;
    } else {
      this.#buf = new Uint8Array(Math.max(1, initialCapacity));
      this.#view = new DataView(this.#buf.buffer);
    }
  }
  #ensure(n: number): void {
    if (this.#pos + n <= this.#buf.length) return;
    if (this.#buf === FINISHED) throw new Error('ByteWriter: written to after finish()');
    let cap = Math.max(64, this.#buf.length * 2);
    while (cap < this.#pos + n) cap *= 2;
    const next = new Uint8Array(cap);
    next.set(this.#buf.subarray(0, this.#pos));
    this.#giveBack();
    this.#buf = next;
    this.#view = new DataView(next.buffer);
  }
  /** The borrowed scratch goes back to the pool (the writer no longer uses it). */
  #giveBack(): void {
    if (!this.#borrowed) return;
    this.#borrowed = false;
    scratch = this.#buf;
    scratchView = this.#view;
    scratchMissed = 0;
  }
  u8(v: number): this {
    this.#ensure(1);
    this.#view.setUint8(this.#pos, v);
    this.#pos += 1;
    return this;
  }
  u16(v: number): this {
    this.#ensure(2);
    this.#view.setUint16(this.#pos, v);
    this.#pos += 2;
    return this;
  }
  u32(v: number): this {
    this.#ensure(4);
    this.#view.setUint32(this.#pos, v);
    this.#pos += 4;
    return this;
  }
  u64(v: bigint | number): this {
    this.#ensure(8);
    if (typeof v === 'number' && v >= 0 && v <= Number.MAX_SAFE_INTEGER && Number.isInteger(v)) {
      // Two u32 halves: no BigInt made per field.
      this.#view.setUint32(this.#pos, Math.floor(v / 0x1_0000_0000));
      this.#view.setUint32(this.#pos + 4, v >>> 0);
    } else this.#view.setBigUint64(this.#pos, BigInt(v));
    this.#pos += 8;
    return this;
  }
  bytes(v: Uint8Array): this {
    this.#ensure(v.length);
    this.#buf.set(v, this.#pos);
    this.#pos += v.length;
    return this;
  }
  /** u16 length, then the bytes. */
  blob16(v: Uint8Array): this {
    if (v.length > 0xffff) throw new InvalidInputError(`field of ${v.length} bytes exceeds 65535`);
    return this.u16(v.length).bytes(v);
  }
  /** u32 length, then the bytes. */
  blob32(v: Uint8Array): this {
    return this.u32(v.length).bytes(v);
  }
  /** u8 length, then UTF-8. */
  str8(v: string): this {
    const n = v.length;
    if (n <= 0xff) {
      // ASCII (ids, tokens, names): written in place, no encoded copy made first.
      this.#ensure(1 + n);
      const buf = this.#buf;
      const at = this.#pos + 1;
      let i = 0;
      for (; i < n; i++) {
        const c = v.charCodeAt(i);
        if (c >= 0x80) break;
        buf[at + i] = c;
      }
      if (i === n) {
        buf[this.#pos] = n;
        this.#pos = at + n;
        return this;
      }
    }
    const b = textEncoder.encode(v);
    if (b.length > 0xff) throw new InvalidInputError(`string of ${b.length} bytes exceeds 255`);
    return this.u8(b.length).bytes(b);
  }
  /** A copy of the bytes written. The writer is done: further writes and finish() throw. */
  finish(): Uint8Array {
    if (this.#buf === FINISHED) throw new Error('ByteWriter: finish() called twice');
    const out = this.#buf.slice(0, this.#pos);
    this.#giveBack();
    this.#buf = FINISHED;
    this.#view = FINISHED_VIEW;
    return out;
  }
}

export class ByteReader {
  readonly #buf: Uint8Array;
  readonly #view: DataView;
  readonly #what: string;
  #pos = 0;
  constructor(buf: Uint8Array, what: string) {
    if (!(buf instanceof Uint8Array)) throw new InvalidInputError(`${what} must be a Uint8Array`);
    this.#buf = buf;
    this.#view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
    this.#what = what;
  }
  get remaining(): number {
    return this.#buf.length - this.#pos;
  }
  #need(n: number, field: string): void {
    if (this.#pos + n > this.#buf.length) {
      throw new InvalidInputError(`${this.#what} is truncated: ${field} needs ${n} bytes, ${this.remaining} left`, {
        details: { field },
      });
    }
  }
  u8(field: string): number {
    this.#need(1, field);
    return this.#view.getUint8(this.#pos++);
  }
  u16(field: string): number {
    this.#need(2, field);
    const v = this.#view.getUint16(this.#pos);
    this.#pos += 2;
    return v;
  }
  u32(field: string): number {
    this.#need(4, field);
    const v = this.#view.getUint32(this.#pos);
    this.#pos += 4;
    return v;
  }
  u64(field: string): bigint {
    this.#need(8, field);
    const v = this.#view.getBigUint64(this.#pos);
    this.#pos += 8;
    return v;
  }
  /** A u64 that must fit a safe JS integer. */
  safeU64(field: string): number {
    this.#need(8, field);
    // Two u32 halves (no BigInt per field): below 2^53 exactly when the high half is below 2^21.
    const hi = this.#view.getUint32(this.#pos);
    if (hi >= 0x20_0000) {
      const v = this.#view.getBigUint64(this.#pos);
      throw new InvalidInputError(`${this.#what}: ${field} ${v} exceeds the largest safe integer`, { details: { field } });
    }
    const lo = this.#view.getUint32(this.#pos + 4);
    this.#pos += 8;
    return hi * 0x1_0000_0000 + lo;
  }
  bytes(n: number, field: string): Uint8Array {
    this.#need(n, field);
    const v = this.#buf.subarray(this.#pos, this.#pos + n);
    this.#pos += n;
    return v;
  }
  blob16(field: string): Uint8Array {
    return this.bytes(this.u16(field), field);
  }
  blob32(field: string, max: number): Uint8Array {
    const n = this.u32(field);
    if (n > max) throw new InvalidInputError(`${this.#what}: ${field} of ${n} bytes exceeds ${max}`, { details: { field } });
    return this.bytes(n, field);
  }
  str8(field: string): string {
    const b = this.bytes(this.u8(field), field);
    try {
      return textDecoder.decode(b);
    } catch (cause) {
      throw new InvalidInputError(`${this.#what}: ${field} is not valid UTF-8`, { cause, details: { field } });
    }
  }
  /** Throws unless every byte was consumed. */
  end(): void {
    if (this.remaining !== 0) {
      throw new InvalidInputError(`${this.#what} has ${this.remaining} trailing bytes`, { details: { field: 'trailing' } });
    }
  }
}

export function toHex(b: Uint8Array): string {
  return Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString('hex');
}

export function fromHex(s: string, what: string): Uint8Array {
  if (!/^(?:[0-9a-f]{2})*$/i.test(s)) throw new InvalidInputError(`${what} is not hex`);
  return new Uint8Array(Buffer.from(s, 'hex'));
}

/** Constant-time comparison for tokens. */
export function equalBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= (a[i] as number) ^ (b[i] as number);
  return diff === 0;
}
