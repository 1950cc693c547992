import Table from 'cli-table3';
import type { ScenarioResult } from './types.js';
import { formatBytes } from './units.js';

const fmt = (n: number | undefined, digits = 2): string => (n === undefined || !Number.isFinite(n) ? '' : n.toFixed(digits));

/** Human-readable tables, one per scenario. */
export function renderTables(results: readonly ScenarioResult[]): string {
  const out: string[] = [];
  for (const r of results) {
    out.push(`\n== ${r.scenario} ==`);
    if (r.skipped) {
      out.push(`skipped: ${r.skipped}`);
      for (const n of r.notes) out.push(`  ${n}`);
      continue;
    }
    // Descriptor columns only where a scenario reports descriptors (kv).
    const desc = r.measurements.some((m) => m.descriptors !== undefined);
    const head = ['measurement', 'role', 'block', ...(desc ? ['desc'] : []), 'GB/s', ...(desc ? ['desc/s'] : []), 'ops/s', 'p50 ms', 'p99 ms'];
    const t = new Table({ head, style: { head: [], border: [] } });
    for (const m of r.measurements) {
      const d = desc ? [m.descriptors === undefined ? '' : String(m.descriptors)] : [];
      const dps = desc ? [m.descriptorsPerSec === undefined ? '' : fmt(m.descriptorsPerSec, 0)] : [];
      t.push([m.name, m.role, m.blockBytes ? formatBytes(m.blockBytes) : '', ...d, fmt(m.gbps), ...dps, m.opsPerSec ? fmt(m.opsPerSec, 0) : '', fmt(m.latency?.p50Ms, 3), fmt(m.latency?.p99Ms, 3)]);
    }
    out.push(t.toString());
    if (r.ratios.length > 0) {
      const rt = new Table({ head: ['ratio', 'value', 'goal', 'met'], style: { head: [], border: [] } });
      for (const x of r.ratios) rt.push([x.name, fmt(x.value, 3), x.goal === undefined ? '' : `>= ${x.goal}`, x.pass === undefined ? '' : x.pass ? 'yes' : 'NO']);
      out.push(rt.toString());
    }
    out.push(`verification failures: ${r.verificationFailures}`);
    if (r.counters) out.push(`counters: ${Object.entries(r.counters).map(([k, v]) => `${k}=${v}`).join(' ')}`);
    for (const n of r.notes) out.push(`  ${n}`);
  }
  return out.join('\n');
}
