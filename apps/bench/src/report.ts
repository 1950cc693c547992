/**
 * `--report FILE.html`: one self-contained page (inline SVG, no scripts or external assets)
 * with, per scenario, GB/s against block size and the latency distributions (CDF).
 */
import type { ScenarioResult } from './types.js';
import { formatBytes } from './units.js';
import { renderTables } from './render.js';

const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#17becf'];
const esc = (s: string): string => s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

interface Series {
  name: string;
  points: [number, number][];
}

function lineChart(title: string, series: Series[], xLabel: string, yLabel: string, logX: boolean, xFmt: (x: number) => string): string {
  const W = 720;
  const H = 320;
  const L = 60;
  const B = 40;
  const T = 30;
  const R = 250;
  const all = series.flatMap((s) => s.points);
  if (all.length === 0) return '';
  const xs = all.map((p) => (logX ? Math.log2(p[0]) : p[0]));
  const ys = all.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs) === Math.min(...xs) ? Math.min(...xs) + 1 : Math.max(...xs)];
  const y1 = Math.max(...ys) * 1.1 || 1;
  const px = (x: number): number => L + (((logX ? Math.log2(x) : x) - x0) / (x1 - x0)) * (W - L - R);
  const py = (y: number): number => H - B - (y / y1) * (H - B - T);
  const parts: string[] = [`<svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img" aria-label="${esc(title)}">`];
  parts.push(`<text x="${W / 2 - R / 2}" y="18" text-anchor="middle" font-weight="bold">${esc(title)}</text>`);
  parts.push(`<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#333"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#333"/>`);
  for (let i = 0; i <= 4; i++) {
    const y = (y1 * i) / 4;
    parts.push(`<text x="${L - 6}" y="${py(y) + 4}" text-anchor="end" font-size="11">${y.toFixed(y1 < 1 ? 3 : 2)}</text><line x1="${L}" x2="${W - R}" y1="${py(y)}" y2="${py(y)}" stroke="#eee"/>`);
  }
  const lo = Math.min(...all.map((p) => p[0]));
  const hi = Math.max(...all.map((p) => p[0]));
  // Log axes tick at the measured sizes; linear axes at five even steps.
  const ticks = logX ? [...new Set(all.map((p) => p[0]))].sort((a, b) => a - b) : Array.from({ length: 5 }, (_, i) => lo + ((hi - lo) * i) / 4);
  const step = Math.max(1, Math.ceil(ticks.length / 8));
  ticks.forEach((x, i) => {
    if (i % step === 0) parts.push(`<text x="${px(x)}" y="${H - B + 16}" text-anchor="middle" font-size="11">${esc(xFmt(x))}</text>`);
  });
  parts.push(`<text x="${(L + W - R) / 2}" y="${H - 6}" text-anchor="middle" font-size="12">${esc(xLabel)}</text>`);
  parts.push(`<text x="14" y="${H / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 ${H / 2})">${esc(yLabel)}</text>`);
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length] as string;
    const pts = [...s.points].sort((a, b) => a[0] - b[0]);
    parts.push(`<polyline fill="none" stroke="${color}" stroke-width="2" points="${pts.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(' ')}"/>`);
    if (pts.length < 40) for (const p of pts) parts.push(`<circle cx="${px(p[0]).toFixed(1)}" cy="${py(p[1]).toFixed(1)}" r="3" fill="${color}"/>`);
    parts.push(`<rect x="${W - R + 10}" y="${T + i * 18}" width="10" height="10" fill="${color}"/><text x="${W - R + 24}" y="${T + 9 + i * 18}" font-size="11">${esc(s.name.slice(0, 38))}</text>`);
  });
  parts.push('</svg>');
  return parts.join('');
}

export function renderHtml(output: { command: string; startedAt: string; machine: Record<string, unknown>; results: readonly ScenarioResult[] }): string {
  const sections: string[] = [];
  for (const r of output.results) {
    const charts: string[] = [];
    const bySize = new Map<string, Series>();
    const byBatch = new Map<string, Series>();
    for (const m of r.measurements) {
      if (m.blockBytes === undefined || m.gbps === undefined) continue;
      // kv: the block-size sweep is one chart, the batch-size sweep (descriptors/s) another.
      const sweep = m.extra?.['sweep'];
      if (sweep === 'batch' || sweep === 'size+batch') {
        const b = byBatch.get(m.name) ?? { name: m.name, points: [] };
        if (m.descriptors !== undefined && m.descriptorsPerSec !== undefined) b.points.push([m.descriptors, m.descriptorsPerSec / 1e6]);
        byBatch.set(m.name, b);
      }
      if (sweep === 'batch' || sweep === 'plain') continue;
      const s = bySize.get(m.name) ?? { name: m.name, points: [] };
      s.points.push([m.blockBytes, m.gbps]);
      bySize.set(m.name, s);
    }
    if ([...bySize.values()].some((s) => s.points.length > 0)) {
      charts.push(lineChart(`${r.scenario}: GB/s by block size`, [...bySize.values()], 'block size', 'GB/s', true, formatBytes));
    }
    if ([...byBatch.values()].some((s) => s.points.length > 0)) {
      charts.push(lineChart(`${r.scenario}: descriptors per second by batch size`, [...byBatch.values()], 'descriptors per fetch', 'million descriptors/s', true, (x) => String(x)));
    }
    const cdfs: Series[] = [];
    for (const m of r.measurements) {
      const samples = m.latency?.samplesMs;
      if (!samples || samples.length < 2) continue;
      const sorted = [...samples].sort((a, b) => a - b);
      cdfs.push({ name: `${m.name}${m.blockBytes ? ` ${formatBytes(m.blockBytes)}` : ''}`, points: sorted.map((v, i) => [v, (i + 1) / sorted.length]) });
    }
    if (cdfs.length > 0) charts.push(lineChart(`${r.scenario}: latency distribution (CDF)`, cdfs.slice(0, 8), 'latency (ms)', 'fraction ≤', false, (x) => x.toFixed(2)));
    sections.push(`<section><h2>${esc(r.scenario)}</h2>${r.skipped ? `<p><b>skipped:</b> ${esc(r.skipped)}</p>` : ''}${charts.join('')}<pre>${esc(renderTables([r]))}</pre></section>`);
  }
  return `<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tensorwire bench report</title>
<style>body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px}pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:12px}svg{display:block;margin:1em 0}</style></head>
<body><h1>tensorwire bench report</h1><p>${esc(output.command)} — ${esc(output.startedAt)}</p><pre>${esc(JSON.stringify(output.machine, null, 2))}</pre>${sections.join('')}</body></html>\n`;
}
