import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const self = new Map();
const dt = p.timeDeltas; let total = 0;
for (let i = 0; i < p.samples.length; i++) { const n = byId.get(p.samples[i]); const cf = n.callFrame; const k = `${cf.functionName || '(anon)'} ${cf.url.split('/').slice(-2).join('/')}:${cf.lineNumber + 1}`; self.set(k, (self.get(k) ?? 0) + (dt[i] ?? 0)); total += dt[i] ?? 0; }
const rows = [...self].sort((a, b) => b[1] - a[1]).slice(0, +(process.argv[3] ?? 40));
for (const [k, v] of rows) console.log((v / 1000).toFixed(1).padStart(9), 'ms', (100 * v / total).toFixed(1).padStart(5), '%', k);
console.log('total', (total / 1000).toFixed(0), 'ms');
