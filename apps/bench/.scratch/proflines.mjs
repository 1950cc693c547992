import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
for (const fn of process.argv.slice(3)) {
  const lines = new Map(); let url = '';
  for (const n of p.nodes) if (n.callFrame.functionName === fn) { url = n.callFrame.url; for (const pt of n.positionTicks ?? []) lines.set(pt.line, (lines.get(pt.line) ?? 0) + pt.ticks); }
  console.log('==', fn, url.split('/').slice(-2).join('/'));
  for (const [l, t] of [...lines].sort((a, b) => b[1] - a[1]).slice(0, 8)) console.log('  line', l, 'ticks', t);
}
