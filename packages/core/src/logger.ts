/** A minimal structured logger. Pass your own (pino, winston…) or use {@link consoleLogger}. */
export interface Logger {
  debug(message: string, fields?: Record<string, unknown>): void;
  info(message: string, fields?: Record<string, unknown>): void;
  warn(message: string, fields?: Record<string, unknown>): void;
  error(message: string, fields?: Record<string, unknown>): void;
}

export type LogLevel = 'debug' | 'info' | 'warn' | 'error' | 'silent';
const ORDER: Record<LogLevel, number> = { debug: 10, info: 20, warn: 30, error: 40, silent: 100 };

/** Writes one line per record to stderr at or above `level` (default from TENSORWIRE_LOG, else `warn`). */
export function consoleLogger(level: LogLevel = envLevel()): Logger {
  const min = ORDER[level];
  const emit = (l: Exclude<LogLevel, 'silent'>, message: string, fields?: Record<string, unknown>): void => {
    if (ORDER[l] < min) return;
    const extra = fields && Object.keys(fields).length > 0 ? ' ' + safeJson(fields) : '';
    process.stderr.write(`[tensorwire] ${l} ${message}${extra}\n`);
  };
  return {
    debug: (m, f) => emit('debug', m, f),
    info: (m, f) => emit('info', m, f),
    warn: (m, f) => emit('warn', m, f),
    error: (m, f) => emit('error', m, f),
  };
}

export const silentLogger: Logger = { debug() {}, info() {}, warn() {}, error() {} };

function envLevel(): LogLevel {
  const v = process.env['TENSORWIRE_LOG'];
  return v === 'debug' || v === 'info' || v === 'warn' || v === 'error' || v === 'silent' ? v : 'warn';
}

function safeJson(v: unknown): string {
  try {
    return JSON.stringify(v, (_k, x: unknown) => (typeof x === 'bigint' ? x.toString() : x));
  } catch {
    return '[unserializable]';
  }
}
