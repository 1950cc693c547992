import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const skipMs = +(process.argv[3] ?? 0), filt = process.argv[4] ?? '';
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const parent = new Map(); for (const n of p.nodes) for (const c of n.children ?? []) parent.set(c, n);
const self = new Map(); let t = 0, total = 0;
for (let i = 0; i < p.samples.length; i++) { t += p.timeDeltas[i]; if (t / 1000 < skipMs) continue; total += p.timeDeltas[i]; const n = byId.get(p.samples[i]); const cf = n.callFrame; if (!cf.url.includes(filt)) continue;
 // attribute to first non-node caller for context
 let c = parent.get(n.id); let ctx = ''; for (let d = 0; c && d < 8; d++, c = parent.get(c.id)) { if (c.callFrame.url && !c.callFrame.url.startsWith('node:')) { ctx = c.callFrame.functionName + ' ' + c.callFrame.url.split('/').slice(-1)[0] + ':' + (c.callFrame.lineNumber + 1); break; } }
 const k = `${cf.functionName || '(anon)'} ${cf.url.split('/').slice(-2).join('/')}:${cf.lineNumber + 1}  <= ${ctx}`; self.set(k, (self.get(k) ?? 0) + p.timeDeltas[i]); }
for (const [k, v] of [...self].sort((a, b) => b[1] - a[1]).slice(0, +(process.argv[5] ?? 30))) console.log((v / 1000).toFixed(1).padStart(8), 'ms', (100 * v / total).toFixed(1).padStart(5), '%', k);
