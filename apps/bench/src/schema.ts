/**
 * The `--json` output, schema version 1. Stable: fields are only ever added.
 *
 * {
 *   schemaVersion: 1, tool: "tensorwire-bench", version, command, startedAt (ISO), durationMs,
 *   machine: { platform, arch, cpus, cpuModel, memoryBytes, node },
 *   results: ScenarioResult[]   (see types.ts)
 * }
 */
export const SCHEMA_VERSION = 1;

const latency = {
  type: 'object',
  required: ['count', 'p50Ms', 'p99Ms'],
  properties: { count: { type: 'integer', minimum: 0 }, p50Ms: { type: 'number' }, p99Ms: { type: 'number' }, samplesMs: { type: 'array', items: { type: 'number' } } },
} as const;

export const benchOutputSchema = {
  $schema: 'http://json-schema.org/draft-07/schema#',
  $id: 'https://tensorwire.dev/schemas/bench-output-v1.json',
  type: 'object',
  required: ['schemaVersion', 'tool', 'version', 'command', 'startedAt', 'durationMs', 'machine', 'results'],
  properties: {
    schemaVersion: { const: SCHEMA_VERSION },
    tool: { const: 'tensorwire-bench' },
    version: { type: 'string' },
    command: { type: 'string' },
    startedAt: { type: 'string' },
    durationMs: { type: 'number', minimum: 0 },
    machine: {
      type: 'object',
      required: ['platform', 'arch', 'cpus', 'node'],
      properties: { platform: { type: 'string' }, arch: { type: 'string' }, cpus: { type: 'integer' }, cpuModel: { type: 'string' }, memoryBytes: { type: 'number' }, node: { type: 'string' } },
    },
    results: {
      type: 'array',
      items: {
        type: 'object',
        required: ['scenario', 'measurements', 'ratios', 'verificationFailures', 'notes'],
        properties: {
          scenario: { type: 'string' },
          skipped: { type: 'string' },
          verificationFailures: { type: 'integer', minimum: 0 },
          notes: { type: 'array', items: { type: 'string' } },
          counters: { type: 'object', additionalProperties: { type: 'number' } },
          measurements: {
            type: 'array',
            items: {
              type: 'object',
              required: ['name', 'role'],
              properties: {
                name: { type: 'string' },
                role: { enum: ['subject', 'baseline', 'external'] },
                blockBytes: { type: 'integer', minimum: 1 },
                totalBytes: { type: 'number', minimum: 0 },
                gbps: { type: 'number', minimum: 0 },
                opsPerSec: { type: 'number', minimum: 0 },
                latency,
                descriptors: { type: 'integer', minimum: 1 },
                descriptorsPerSec: { type: 'number', minimum: 0 },
                transport: { type: 'string' },
                extra: { type: 'object' },
              },
            },
          },
          ratios: {
            type: 'array',
            items: {
              type: 'object',
              required: ['name', 'subject', 'baseline', 'value'],
              properties: {
                name: { type: 'string' },
                subject: { type: 'string' },
                baseline: { type: 'string' },
                blockBytes: { type: 'integer' },
                descriptors: { type: 'integer', minimum: 1 },
                value: { type: 'number' },
                rounds: { type: 'array', items: { type: 'number' } },
                goal: { type: 'number' },
                pass: { type: 'boolean' },
              },
            },
          },
        },
      },
    },
  },
} as const;
