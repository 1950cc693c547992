import { PreparedTransfer, TransferEngine } from '@tensorwire/core';
let rebinds = 0, prepares = 0;
const rb = PreparedTransfer.prototype.rebind; PreparedTransfer.prototype.rebind = function (...a) { rebinds++; return rb.apply(this, a); };
const pp = TransferEngine.prototype.prepare; TransferEngine.prototype.prepare = function (...a) { prepares++; return pp.apply(this, a); };
process.on('exit', () => console.log('rebinds', rebinds, 'prepares', prepares));
await import('./ab.mjs');
