import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const skipMs = +(process.argv[3] ?? 0); const target = process.argv[4];
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const parent = new Map(); for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n);
const kids = new Map(); let t = 0, tot = 0;
for (let i = 0; i < p.samples.length; i++) { t += p.timeDeltas[i]; if (t / 1000 < skipMs) continue;
  let child = null; for (let n = byId.get(p.samples[i]); n; child = n, n = parent.get(n.id)) { if (n.callFrame.functionName === target) { const k = child ? `${child.callFrame.functionName || '(anon)'} ${child.callFrame.url.split('/').slice(-1)[0]}:${child.callFrame.lineNumber + 1}` : '(self)'; kids.set(k, (kids.get(k) ?? 0) + p.timeDeltas[i]); tot += p.timeDeltas[i]; break; } } }
for (const [k, v] of [...kids].sort((a, b) => b[1] - a[1]).slice(0, 25)) console.log((v / 1000).toFixed(1).padStart(8), 'ms', k);
console.log('total', (tot / 1000).toFixed(1));
