/**
 * The transport kit: everything a v2 transport on byte streams needs but the medium.
 *
 * - `frames`: the wire format (the TCP transport's protocol v2), bounded decoders, and the
 *   scatter receiver ({@link FrameParser}) that lands data straight in its destinations.
 * - `handshake`: HELLO/HELLO_ACK with identity validation and the expected-peer check.
 * - `grants`: the grant table (128-bit tokens, O(1) bounds per range, revocation that waits only
 *   for that grant's in-flight use, then aborts its users after a grace).
 * - `batch`: per-batch plans (checked ranges, encoded request frames), cached per batch object.
 * - `stream` / `connection`: one socket's requester and responder; N streams grouped into a
 *   connection with GOAWAY/retire, close and quiesce, onClose exactly once.
 * - `peer-events`: {@link PeerEvents}, the bounds applied to peers counted per kind, logged at
 *   most once a second per kind (with the number left out), and counted in prom-client
 *   ({@link KitMetrics}); the kit's transports, cuda-ipc and rdma-verbs use it.
 * - `transport`: {@link StreamTransport}, the base class; a subclass provides `listen`,
 *   `dialTarget` and `unreachableReason` (see the Unix-socket transport, uds/transport.ts).
 */
export * from './frames.js';
export * from './handshake.js';
export * from './grants.js';
export * from './batch.js';
export * from './stream.js';
export * from './connection.js';
export * from './peer-events.js';
export * from './transport.js';
