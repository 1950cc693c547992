import { mkdirSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { NativeDeviceInfo } from '../src/native.js';

export interface Fixture {
  readonly sysfs: { numa_node: string; gid_types: Record<string, string>; gid_ndevs: Record<string, string> };
  readonly device: NativeDeviceInfo & { name: string };
}

export function loadFixture(name: string): Fixture {
  return JSON.parse(readFileSync(new URL(`./fixtures/${name}.json`, import.meta.url), 'utf8')) as Fixture;
}

/** Lay the fixture's sysfs facts out like /sys/class/infiniband/<dev>/... under a temp root. */
export function writeSysfs(fixtures: readonly Fixture[]): string {
  const root = mkdtempSync(join(tmpdir(), 'tw-rdma-sysfs-'));
  for (const f of fixtures) {
    const dev = join(root, f.device.name);
    mkdirSync(join(dev, 'device'), { recursive: true });
    writeFileSync(join(dev, 'device', 'numa_node'), `${f.sysfs.numa_node}\n`);
    for (const p of f.device.ports ?? []) {
      const base = join(dev, 'ports', String(p.port), 'gid_attrs');
      mkdirSync(join(base, 'types'), { recursive: true });
      mkdirSync(join(base, 'ndevs'), { recursive: true });
      for (const [i, t] of Object.entries(f.sysfs.gid_types)) writeFileSync(join(base, 'types', i), `${t}\n`);
      for (const [i, n] of Object.entries(f.sysfs.gid_ndevs)) writeFileSync(join(base, 'ndevs', i), `${n}\n`);
    }
  }
  return root;
}
