/**
 * Lease-scoped range grants on a holder: register memory once, grant per lease.
 *
 * `engineGrants({ engine, blocks })` gives the lock service a `pin`, a `resolve` and a
 * `revoke`: each lease gets ONE range grant from the engine over the ranges of its blocks
 * (block i of the lease is range i), sent to the requester as one lease descriptor; a lease
 * whose blocks are all one size in one registration, on one grid of that size (a KV arena),
 * is granted as a block grant (4 bytes per block, about the cost of a copy); when the
 * lease ends (released, expired by the GC, abandoned, shutdown) the grant is revoked, exactly
 * once. Counters: `issued = revoked + live`, always. `blocks` is asked once per block when the
 * block is pinned; the lease table keeps the answer with the pin while the block stays pinned
 * (a pinned block does not move) and hands it to each lease in `LeaseInfo.pinValues`, so a
 * lease's grant looks up nothing again.
 *
 * A KV arena is best served as a numbered block space (`spaces`): its blocks are leased by
 * number (`block:<owner>:<n>` is block n of the arena's grid), the lease table counts their pins
 * in a typed array, and a lease's grant is the block grant of its numbers as they came: no
 * string, object or lookup per block on the holder.
 *
 * ```ts
 * const grants = engineGrants({ engine, blocks: new Map([['block:kv:0', { registration, offset: 0, length: 4096 }]]) });
 * const server = await startLockServer({ holderId: 'h', ...grants.lockServerOptions });
 * // or, for an arena of 4 KiB blocks leased by number (client.acquire(holder, { owner: 'kv', numbers })):
 * const arena = engineGrants({ engine, spaces: { kv: { registration, blockBytes: 4096 } } });
 * ```
 */
import { GRANT_STRIDE, InvalidInputError, Registration, ownerProblem, type Grant, type GrantRange, type Logger, type TransferEngine, silentLogger } from '@tensorwire/core';
import { LeaseError } from '../errors.js';
import { encodeFetchDescriptor } from '../fetch-descriptor.js';
import type { NumberedBlocks } from '../ids.js';
import { MAX_SPACE_BLOCKS, type BlockSpace, type LeaseEndReason, type LeaseInfo } from './lease-table.js';
import type { AcquireHints, ResolvedLease } from './server.js';

export interface EngineGrantsOptions {
  /** The holder's engine (started or not); its transports serve the grants. */
  readonly engine: TransferEngine;
  /** Where each block named by id lives: a range of a registration of `engine`. Default: no block by id. */
  readonly blocks?: ReadonlyMap<string, GrantRange> | ((blockId: string) => GrantRange | undefined);
  /**
   * Numbered block spaces by owner (a KV arena): block `n` of space `owner` (`block:<owner>:<n>`)
   * is bytes `[base + n × blockBytes, + blockBytes)` of `registration`. Their leases are block
   * grants of the lease's numbers. Passed on to the lease table (`lockServerOptions.spaces`).
   */
  readonly spaces?: Readonly<Record<string, EngineBlockSpace>>;
  /**
   * Transports that must grant (default: every one that can). A lease whose acquire names the
   * transports its requester reads through (`AcquireOptions.transports`) is granted over those
   * of them that can grant its blocks (and are in this list, when given) only; when none can,
   * or their grant fails, over this set as usual.
   */
  readonly transports?: readonly string[];
  readonly logger?: Logger;
}

/** A numbered block space served by {@link engineGrants}: a grid of equal blocks in one registration. */
export interface EngineBlockSpace {
  /** The registration of the engine the blocks lie in. */
  readonly registration: Registration;
  /** Bytes per block (a positive integer). */
  readonly blockBytes: number;
  /** Offset of block 0 in the registration (default 0). */
  readonly base?: number;
  /** Blocks in the space (default: every whole block from `base` to the registration's end; at most 2^28). */
  readonly count?: number;
  /** Blocks that went from 0 to 1 live leases (see {@link BlockSpace.pin}). */
  readonly pin?: BlockSpace['pin'];
  /** Blocks that went from 1 to 0 live leases (see {@link BlockSpace.unpin}). */
  readonly unpin?: BlockSpace['unpin'];
}

export interface EngineGrantCounters {
  /** Grants made (one per lease that was resolved). */
  readonly issued: number;
  /** Grants revoked (each exactly once). */
  readonly revoked: number;
  /** Grants live now: issued - revoked. */
  readonly live: number;
  /** Leases whose grant could not be made (the acquire failed). */
  readonly failed: number;
}

export interface EngineGrants {
  /**
   * Refuses blocks this holder does not have (NOT_FOUND), before anything is pinned; returns
   * where the block lies, which the lease table keeps with the pin (`LeaseInfo.pinValues`).
   */
  pin(blockId: string): GrantRange;
  /** The block's last lease ended (nothing to forget: the lease table drops the pin's value). */
  unpin(blockId: string): void;
  /** One range grant over the lease's blocks, as one lease descriptor (over the transports `hints` names, where they can grant). */
  resolve(blockIds: readonly string[], lease: LeaseInfo, hints?: AcquireHints): Promise<ResolvedLease>;
  /** `resolve` of the lease's own blocks (a lease by number: its numbers, without formatting its ids). */
  resolveLease(lease: LeaseInfo, hints?: AcquireHints): Promise<ResolvedLease>;
  /** The lease ended: revoke its grant (once; a grant still being made is revoked when made). */
  revoke(lease: LeaseInfo, reason: LeaseEndReason): void;
  /** `{ pin, unpin, resolveLease, revoke, spaces }`, to spread into `startLockServer` options. */
  readonly lockServerOptions: {
    readonly pin: (blockId: string) => GrantRange;
    readonly unpin: (blockId: string) => void;
    readonly resolveLease: (lease: LeaseInfo, hints?: AcquireHints) => Promise<ResolvedLease>;
    readonly revoke: (lease: LeaseInfo, reason: LeaseEndReason) => void;
    /** The numbered spaces, as the lease table takes them (their counts and hooks). */
    readonly spaces: Readonly<Record<string, BlockSpace>>;
  };
  counters(): EngineGrantCounters;
  /** Resolves once every revocation started so far has finished. */
  settled(): Promise<void>;
}

/** A lease whose grant is being made, made, or whose lease ended while it was being made. */
type Slot = { state: 'pending' } | { state: 'ended' } | { state: 'live'; grant: Grant };

export function engineGrants(options: EngineGrantsOptions): EngineGrants {
  const { engine } = options;
  const logger = options.logger ?? silentLogger;
  const byId = options.blocks;
  const lookup: (id: string) => GrantRange | undefined = typeof byId === 'function' ? byId : byId === undefined ? () => undefined : (id) => byId.get(id);
  const spaces = checkSpaces(options.spaces);
  const tableSpaces: Record<string, BlockSpace> = {};
  for (const [owner, sp] of spaces) tableSpaces[owner] = { count: sp.count, ...(sp.pin ? { pin: sp.pin } : {}), ...(sp.unpin ? { unpin: sp.unpin } : {}) };
  const slots = new Map<string, Slot>();
  const revoking = new Set<Promise<void>>();
  let issued = 0;
  let revoked = 0;
  let failed = 0;

  // One scratch array for every lease's ranges, and one for its block indices (grown as
  // needed), instead of arrays per lease.
  let scratch = new Float64Array(0);
  const scratchFor = (n: number): Float64Array => {
    if (scratch.length < n) scratch = new Float64Array(2 ** Math.ceil(Math.log2(n)));
    return scratch.length === n ? scratch : scratch.subarray(0, n);
  };
  let blockScratch = new Uint32Array(0);
  const blockScratchFor = (n: number): Uint32Array => {
    if (blockScratch.length < n) blockScratch = new Uint32Array(2 ** Math.ceil(Math.log2(n)));
    return blockScratch.length === n ? blockScratch : blockScratch.subarray(0, n);
  };

  const revokeGrant = (sessionId: string, grant: Grant): void => {
    revoked++;
    const p = grant.revoke().catch((e: unknown) => logger.warn('lock: revoking a lease grant failed', { sessionId, error: e instanceof Error ? e.message : String(e) }));
    revoking.add(p);
    void p.finally(() => revoking.delete(p));
  };

  // Where each block lies, from its pin (the lease table pins a block when its first live lease
  // takes it, keeps what this returns with the pin, and drops it after the last): so never stale.
  const pin = (blockId: string): GrantRange => {
    const r = lookup(blockId);
    if (r === undefined) throw new LeaseError('NOT_FOUND', `no block ${blockId} on this holder`);
    return r;
  };

  const unpin = (): void => undefined;

  const resolve = (blockIds: readonly string[], lease: LeaseInfo, hints?: AcquireHints): Promise<ResolvedLease> =>
    grantFor(lease.blocks !== undefined && blockIds === lease.blockIds ? undefined : blockIds, lease, hints);
  const resolveLease = (lease: LeaseInfo, hints?: AcquireHints): Promise<ResolvedLease> => grantFor(lease.blocks !== undefined ? undefined : lease.blockIds, lease, hints);

  /** Names of the engine's transports that make range grants (its transports are fixed once it exists). */
  let granting: ReadonlySet<string> | undefined;
  /**
   * Of the transports the requester named, those that may grant over `regs`: granting
   * transports of the engine (in `options.transports` when given) with a handle for every one
   * of them. Undefined when it named none or none is left: the usual set.
   */
  const namedTransports = (hints: AcquireHints | undefined, regs: readonly Registration[]): string[] | undefined => {
    const named = hints?.transports;
    if (named === undefined || named.length === 0) return undefined;
    granting ??= new Set(engine.transports.filter((t) => typeof t.grant === 'function' && typeof t.revokeGrant === 'function').map((t) => t.name));
    let out: string[] | undefined;
    for (const name of named) {
      if (!granting.has(name) || (options.transports !== undefined && !options.transports.includes(name))) continue;
      if (regs.every((r) => r.handleFor(name) !== undefined)) (out ??= []).push(name);
    }
    return out;
  };

  /** What engineGrants grants over when the acquire named no transport it can use. */
  const usual = options.transports ? { transports: options.transports } : {};
  type Spec = Parameters<TransferEngine['grant']>[0];
  /** The grant of `spec` over the `named` transports, else (none named, or their grant failed) over the usual set, of the spec `again()` gives. */
  const grantOver = (spec: Spec, named: string[] | undefined, again: () => Spec): Promise<Grant> =>
    named === undefined ? engine.grant(spec, usual) : engine.grant(spec, { transports: named }).catch(() => engine.grant(again(), usual));

  /** The lease ended (the lease table's `live`; a LeaseInfo made elsewhere without it counts as live). */
  const ended = (lease: LeaseInfo): boolean => lease.live === false;
  /** The grant of `blockIds`, or (undefined) of the lease's own numbered blocks. */
  const grantFor = async (blockIds: readonly string[] | undefined, lease: LeaseInfo, hints: AcquireHints | undefined): Promise<ResolvedLease> => {
    const sessionId = lease.sessionId;
    // A resolver of the holder's that awaited something before asking for this grant may ask
    // after the lease ended, when its `revoke` has come and gone: no grant for it.
    if (ended(lease)) throw new LeaseError('ABORTED', `lease ${sessionId} ended before its grant was asked for`);
    // One grant per lease: `revoke` ends the one grant it knows of, so a second would outlive it.
    if (slots.has(sessionId)) throw new LeaseError('INTERNAL', `lease ${sessionId} already has its grant (the holder's resolver asked engineGrants twice)`);
    slots.set(sessionId, { state: 'pending' });
    let grant: Grant;
    try {
      // A lease of numbered blocks is the block grant of its numbers, as they came (the lease
      // table checked them against the space).
      const own = blockIds === undefined ? lease.blocks : undefined;
      const numbered = own === undefined ? undefined : spaces.get(own.owner);
      if (own !== undefined && numbered === undefined) throw new LeaseError('NOT_FOUND', `no numbered blocks of owner ${own.owner} on this holder`);
      if (numbered !== undefined) {
        const spec = { registration: numbered.registration, blockBytes: numbered.blockBytes, base: numbered.base, blocks: (own as NumberedBlocks).numbers };
        grant = await grantOver(spec, namedTransports(hints, [numbered.registration]), () => spec);
      } else {
        const ids = blockIds ?? [];
        const { spec, registrations } = idSpec(ids, lease);
        // The scratch arrays may serve another lease by the time a second grant is made: it lays the lease out again.
        grant = await grantOver(spec, namedTransports(hints, registrations), () => idSpec(ids, lease).spec);
      }
    } catch (e) {
      failed++;
      slots.delete(sessionId);
      // The requester's input was checked by the lease table; a grant that cannot be made is the
      // holder's problem (a revoked registration, a bad block map, no transport), not INVALID_ARGUMENT.
      if (e instanceof LeaseError) throw e;
      throw new LeaseError('UNAVAILABLE', `the holder could not grant the lease's blocks: ${e instanceof Error ? e.message : String(e)}`);
    }
    issued++;
    const slot = slots.get(sessionId);
    if (slot?.state !== 'pending' || ended(lease)) {
      // The lease ended while the grant was being made: it must not outlive it.
      slots.delete(sessionId);
      revokeGrant(sessionId, grant);
      throw new LeaseError('ABORTED', `lease ${sessionId} ended before its grant was made`);
    }
    slots.set(sessionId, { state: 'live', grant });
    return { lease: [encodeFetchDescriptor(engine.endpoint(), grant.descriptor)] };
  };

  /**
   * The grant spec of a lease's blocks by id, laid out in the scratch arrays (free again once
   * `engine.grant()` has returned its promise: the engine copies them first), and the distinct
   * registrations they lie in.
   */
  const idSpec = (ids: readonly string[], lease: LeaseInfo): { spec: Spec; registrations: readonly Registration[] } => {
    // One typed array for the whole lease: no object per block past the lookup.
    const registrations: Registration[] = [];
    const index = new Map<Registration, number>();
    const n = ids.length;
    const ranges = scratchFor(n * GRANT_STRIDE);
    // While every block is one size in one registration, on one grid of that size (the KV
    // arena case), the lease is also a block grant: one u32 per block, checked by the engine
    // at about the cost of a copy (GrantBlocksSpec).
    const blocks = blockScratchFor(n);
    let grid = true;
    let blockBytes = 0;
    let phase = 0;
    // What the pins looked up, when the lease is the table's and these are its blocks.
    const values = lease.blocks === undefined && ids === lease.blockIds ? lease.pinValues : undefined;
    for (let i = 0; i < n; i++) {
      const id = ids[i] as string;
      const v = values?.[i] as GrantRange | undefined;
      // A pin hook other than ours (spread over lockServerOptions) may have kept something else.
      const r = v !== undefined && v !== null && v.registration instanceof Registration ? v : lookup(id);
      if (r === undefined) throw new LeaseError('NOT_FOUND', `no block ${id} on this holder`);
      let k = index.get(r.registration);
      if (k === undefined) index.set(r.registration, (k = registrations.push(r.registration) - 1));
      const offset = r.offset ?? 0;
      const length = r.length ?? r.registration.byteLength - offset;
      const at = i * GRANT_STRIDE;
      ranges[at] = k;
      ranges[at + 1] = offset;
      ranges[at + 2] = length;
      if (grid) {
        if (i === 0) {
          blockBytes = length;
          phase = length >= 1 ? offset % length : 0;
        }
        const b = (offset - phase) / blockBytes;
        grid = k === 0 && length === blockBytes && b >= 0 && b <= 0xffffffff && Number.isInteger(b);
        blocks[i] = b;
      }
    }
    return { spec: grid ? { registration: registrations[0] as Registration, blockBytes, base: phase, blocks } : { registrations, ranges }, registrations };
  };

  const revoke = (lease: LeaseInfo): void => {
    const slot = slots.get(lease.sessionId);
    if (slot === undefined || slot.state === 'ended') return;
    if (slot.state === 'pending') {
      slots.set(lease.sessionId, { state: 'ended' });
      return;
    }
    slots.delete(lease.sessionId);
    revokeGrant(lease.sessionId, slot.grant);
  };

  return {
    pin,
    unpin,
    resolve,
    resolveLease,
    revoke,
    lockServerOptions: { pin, unpin, resolveLease, revoke, spaces: tableSpaces },
    counters: () => ({ issued, revoked, live: issued - revoked, failed }),
    settled: async () => {
      while (revoking.size > 0) await Promise.allSettled([...revoking]);
    },
  };
}

interface CheckedSpace {
  readonly registration: Registration;
  readonly blockBytes: number;
  readonly base: number;
  readonly count: number;
  readonly pin: BlockSpace['pin'];
  readonly unpin: BlockSpace['unpin'];
}

/** The spaces of {@link EngineGrantsOptions.spaces}, checked: each grid inside its registration. */
function checkSpaces(spaces: Readonly<Record<string, EngineBlockSpace>> | undefined): Map<string, CheckedSpace> {
  const out = new Map<string, CheckedSpace>();
  for (const [owner, sp] of Object.entries(spaces ?? {})) {
    const field = `spaces.${owner}`;
    const bad = (what: string): never => {
      throw new InvalidInputError(`${field}: ${what}`, { details: { field } });
    };
    const problem = ownerProblem(owner);
    if (problem !== undefined) bad(`the owner ${JSON.stringify(owner)}: ${problem}`);
    if (sp === null || typeof sp !== 'object') bad('expected { registration, blockBytes, base?, count? }');
    if (!(sp.registration instanceof Registration)) bad('registration must be a Registration of the engine');
    const { blockBytes } = sp;
    const base = sp.base ?? 0;
    if (!Number.isSafeInteger(blockBytes) || blockBytes < 1) bad(`blockBytes must be a positive integer, got ${String(blockBytes)}`);
    if (!Number.isSafeInteger(base) || base < 0 || base >= sp.registration.byteLength) bad(`base must be an integer offset inside the registration (${sp.registration.byteLength} bytes), got ${String(base)}`);
    const fit = Math.floor((sp.registration.byteLength - base) / blockBytes);
    const count = sp.count ?? Math.min(fit, MAX_SPACE_BLOCKS);
    if (!Number.isSafeInteger(count) || count < 1 || count > MAX_SPACE_BLOCKS) bad(`count must be an integer from 1 to 2^28, got ${String(count)}`);
    if (count > fit) bad(`${count} blocks of ${blockBytes} bytes from offset ${base} do not fit in the registration (${sp.registration.byteLength} bytes)`);
    out.set(owner, { registration: sp.registration, blockBytes, base, count, pin: sp.pin, unpin: sp.unpin });
  }
  return out;
}
