import { InvalidInputError } from '@tensorwire/core';

/** Element types a slot can hold, with their header codes and sizes. */
export const DTYPES = {
  uint8: { code: 1, size: 1 },
  int8: { code: 2, size: 1 },
  uint16: { code: 3, size: 2 },
  int16: { code: 4, size: 2 },
  uint32: { code: 5, size: 4 },
  int32: { code: 6, size: 4 },
  float16: { code: 7, size: 2 },
  bfloat16: { code: 8, size: 2 },
  float32: { code: 9, size: 4 },
  float64: { code: 10, size: 8 },
  int64: { code: 11, size: 8 },
  uint64: { code: 12, size: 8 },
  bool: { code: 13, size: 1 },
} as const;
export type Dtype = keyof typeof DTYPES;

const BY_CODE = new Map<number, Dtype>(Object.entries(DTYPES).map(([k, v]) => [v.code, k as Dtype]));

export function assertDtype(dtype: unknown): asserts dtype is Dtype {
  if (typeof dtype !== 'string' || !Object.hasOwn(DTYPES, dtype)) {
    throw new InvalidInputError(`dtype ${JSON.stringify(dtype)} is not one of ${Object.keys(DTYPES).join(', ')}`, { details: { field: 'dtype' } });
  }
}

export function dtypeFromCode(code: number): Dtype {
  const d = BY_CODE.get(code);
  if (!d) throw new InvalidInputError(`dtype code ${code} is unknown`, { details: { field: 'dtype' } });
  return d;
}

export type TypedArrayFor = Uint8Array | Int8Array | Uint16Array | Int16Array | Uint32Array | Int32Array | Float32Array | Float64Array | BigInt64Array | BigUint64Array;

/** A typed array over `bytes` for `dtype` (float16/bfloat16 as Uint16Array, bool as Uint8Array). */
export function typedView(dtype: Dtype, buffer: ArrayBufferLike, byteOffset: number, byteLength: number): TypedArrayFor {
  const n = byteLength / DTYPES[dtype].size;
  switch (dtype) {
    case 'uint8':
    case 'bool':
      return new Uint8Array(buffer, byteOffset, n);
    case 'int8':
      return new Int8Array(buffer, byteOffset, n);
    case 'uint16':
    case 'float16':
    case 'bfloat16':
      return new Uint16Array(buffer, byteOffset, n);
    case 'int16':
      return new Int16Array(buffer, byteOffset, n);
    case 'uint32':
      return new Uint32Array(buffer, byteOffset, n);
    case 'int32':
      return new Int32Array(buffer, byteOffset, n);
    case 'float32':
      return new Float32Array(buffer, byteOffset, n);
    case 'float64':
      return new Float64Array(buffer, byteOffset, n);
    case 'int64':
      return new BigInt64Array(buffer, byteOffset, n);
    case 'uint64':
      return new BigUint64Array(buffer, byteOffset, n);
  }
}

export const MAX_NDIM = 8;

/**
 * Validate a shape and return its byte size. Every dimension must be a safe integer >= 1
 * (a zero-sized tensor has nothing to share); the product must stay within `limit`.
 */
export function shapeBytes(shape: unknown, dtype: Dtype, limit: number): number {
  if (!Array.isArray(shape)) throw new InvalidInputError('shape must be an array of positive integers', { details: { field: 'shape' } });
  if (shape.length > MAX_NDIM) throw new InvalidInputError(`shape has ${shape.length} dimensions; at most ${MAX_NDIM}`, { details: { field: 'shape' } });
  let bytes = DTYPES[dtype].size;
  for (let i = 0; i < shape.length; i++) {
    const d: unknown = shape[i];
    if (typeof d !== 'number' || !Number.isSafeInteger(d) || d < 1) {
      throw new InvalidInputError(`shape[${i}] = ${String(d)} must be a positive safe integer`, { details: { field: 'shape' } });
    }
    if (bytes > limit / d) {
      throw new InvalidInputError(`shape [${shape.join(', ')}] of ${dtype} exceeds the slot limit of ${limit} bytes`, { details: { field: 'shape' } });
    }
    bytes *= d;
  }
  if (bytes > limit) throw new InvalidInputError(`shape of ${bytes} bytes exceeds the slot limit of ${limit} bytes`, { details: { field: 'shape' } });
  return bytes;
}
