/**
 * Bench worker: a requester that acquires a lease and holds it until it is killed
 * (fault injection for the `locks` scenario).
 *
 * argv: holder requesterId blockId...
 * → {type:'acquired', sessionId}
 */
import { LockClient } from '@tensorwire/lock-client';
import { workerInit } from '../proc.js';

const io = workerInit();
const [holder, requesterId, ...blockIds] = process.argv.slice(2);
const client = new LockClient({ requesterId: requesterId ?? 'victim' });
const guard = await client.acquire(holder ?? '', blockIds);
io.send({ type: 'acquired', sessionId: guard.sessionId });
// Hold the lease until SIGKILL (or the parent goes away).
setInterval(() => {}, 1 << 30);
