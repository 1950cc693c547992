import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const skipMs = +(process.argv[3] ?? 0); const names = process.argv.slice(4);
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const parent = new Map(); for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n);
const incl = new Map(names.map((n) => [n, 0])); let t = 0, total = 0;
for (let i = 0; i < p.samples.length; i++) { t += p.timeDeltas[i]; if (t / 1000 < skipMs) continue; total += p.timeDeltas[i];
  const seen = new Set(); for (let n = byId.get(p.samples[i]); n; n = parent.get(n.id)) { const fn = n.callFrame.functionName; if (incl.has(fn) && !seen.has(fn)) { seen.add(fn); incl.set(fn, incl.get(fn) + p.timeDeltas[i]); } } }
for (const [k, v] of incl) console.log((v / 1000).toFixed(1).padStart(8), 'ms', k);
console.log('total', (total/1000).toFixed(0));
