import { readFileSync } from 'node:fs';
const p = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const skipMs = +(process.argv[3] ?? 0);
const byId = new Map(p.nodes.map((n) => [n.id, n]));
const g = new Map(); let t = 0, total = 0;
const group = (u, fn) => { if (!u) return fn.startsWith('(') ? fn : 'native/builtin'; if (u.includes('grpc-js')) return 'grpc-js'; if (u.includes('protobufjs') || u.includes('@protobufjs')) return 'protobufjs'; if (u.includes('prom-client')) return 'prom-client'; if (u.startsWith('node:internal/http2') ) return 'node http2'; if (u.startsWith('node:')) return 'node other'; const m = u.match(/packages\/([^/]+)\/dist\/(.*)/); if (m) return m[1] + '/' + m[2]; if (u.includes('apps/bench')) return 'bench'; return u.split('/').slice(-3).join('/'); };
for (let i = 0; i < p.samples.length; i++) { t += p.timeDeltas[i]; if (t / 1000 < skipMs) continue; const n = byId.get(p.samples[i]); const k = group(n.callFrame.url, n.callFrame.functionName); g.set(k, (g.get(k) ?? 0) + p.timeDeltas[i]); total += p.timeDeltas[i]; }
for (const [k, v] of [...g].sort((a, b) => b[1] - a[1]).slice(0, 30)) console.log((v / 1000).toFixed(1).padStart(9), 'ms', (100 * v / total).toFixed(1).padStart(5), '%', k);
console.log('total', (total / 1000).toFixed(0));
