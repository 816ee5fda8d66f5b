// Canonical msgpack (protocol_spec/README.md section 3), data-plane frames (section 5) and relay
// envelopes (relay.md section 5). Pure functions: used by the page and by node's unit tests.

import { Decoder, Encoder } from "../vendor/msgpack/index.mjs";

/** A protocol error carrying its README section 12 code. */
export class ProtocolError extends Error {
  /** @param {string} message @param {number} code */
  constructor(message, code) {
    super(message);
    this.code = code;
    /** @type {Uint8Array | undefined} the request this error answers, when known */
    this.requestId = undefined;
  }
}

export const Code = Object.freeze({
  MALFORMED_FRAME: 1, UNSUPPORTED_VERSION: 2, FRAME_TOO_LARGE: 3, BAD_FIELD: 4, BAD_TENSOR: 5,
  NON_FINITE: 6, UNKNOWN_EXPERT: 7, OVERLOADED: 8, AUTH_FAILED: 9, INTERNAL: 10, UNKNOWN_MESSAGE: 11,
  UNEXPECTED_MESSAGE: 12, DEADLINE_EXCEEDED: 13, STALE: 14,
});

export const Kind = Object.freeze({ CONTROL: 0, OPEN: 1, DATA: 2, CLOSE: 3 });

// Keys are sorted by JavaScript's code-unit order, which equals UTF-8 byte order for every key
// the protocol defines (ASCII); integers take their shortest form, non-negative ones unsigned.
class CanonicalEncoder extends Encoder {
  /** -0.0 is a float (always the 9-byte float64 form), not the integer 0. @param {number} x */
  encodeNumber(x) {
    const self = /** @type {any} */ (this);
    if (Object.is(x, -0)) this.encodeNumberAsFloat(x);
    else if (Number.isSafeInteger(x) && x >= 2 ** 32) {
      self.writeU8(0xcf);
      self.writeU64(x);
    } else if (Number.isSafeInteger(x) && x < -(2 ** 31)) {
      self.writeU8(0xd3);
      self.writeI64(x);
    } else super.encodeNumber(x);
  }
}

// BigInt values (beyond 2^53) encode as uint64/int64 (the only forms that hold them); numbers of 33 to 53
// bits too (the library would write them as floats when BigInt support is on).
const encoder = new CanonicalEncoder({ sortKeys: true, ignoreUndefined: true, useBigInt64: true });

const strictExtensions = {
  /** @returns {null} */
  encode() { return null; },
  /** @returns {never} */
  decode() { throw new ProtocolError("ext types are not allowed", Code.MALFORMED_FRAME); },
};

/** A msgpack float: no v1 field is one, so a float where an int belongs is a bad field, not an int. */
export class WireFloat {
  /** @param {number} value */
  constructor(value) {
    this.value = value;
  }
}

const strictUtf8 = new TextDecoder("utf-8", { fatal: true });

/**
 * Map keys must be str and appear once (section 3). Called by the decoder as its method.
 * @this {any}
 * @param {unknown} key
 */
function checkedKey(key) {
  if (typeof key !== "string") throw new ProtocolError("map keys must be str", Code.MALFORMED_FRAME);
  if (Object.hasOwn(this.stack.top().map, key)) throw new ProtocolError(`duplicate key ${key}`, Code.MALFORMED_FRAME);
  return key;
}

class StrictDecoder extends Decoder {
  /** @param {number} byteLength @param {number} headerOffset */
  decodeUtf8String(byteLength, headerOffset) {
    const at = /** @type {any} */ (this).pos + headerOffset;
    const bytes = /** @type {Uint8Array} */ (/** @type {any} */ (this).bytes);
    if (bytes.byteLength >= at + byteLength) {
      try {
        strictUtf8.decode(bytes.subarray(at, at + byteLength));
      } catch {
        throw new ProtocolError("invalid UTF-8 in a str", Code.MALFORMED_FRAME);
      }
    }
    return super.decodeUtf8String(byteLength, headerOffset);
  }

  readF32() {
    return /** @type {any} */ (new WireFloat(super.readF32()));
  }

  readF64() {
    return /** @type {any} */ (new WireFloat(super.readF64()));
  }
}

const decoder = new StrictDecoder({
  extensionCodec: /** @type {any} */ (strictExtensions), mapKeyConverter: checkedKey,
});

/**
 * Canonical msgpack of a value: maps are plain objects, `bin` is a Uint8Array, `undefined` fields are omitted.
 * @param {unknown} value
 * @returns {Uint8Array}
 */
export function canonical(value) {
  return encoder.encode(value);
}

/**
 * Exactly one msgpack object; ProtocolError code 1 for anything else.
 * @param {Uint8Array} bytes
 * @returns {any}
 */
export function unpackValue(bytes) {
  try {
    return decoder.decode(bytes);
  } catch (e) {
    if (e instanceof ProtocolError) throw e;
    throw new ProtocolError(`not one msgpack object: ${/** @type {Error} */ (e).message}`, Code.MALFORMED_FRAME);
  }
}

/**
 * A frame body: a map with a str `type`.
 * @param {Uint8Array} body
 * @returns {Record<string, any>}
 */
export function decodeBody(body) {
  const m = unpackValue(body);
  if (m === null || typeof m !== "object" || Array.isArray(m) || m instanceof Uint8Array) {
    throw new ProtocolError("frame body is not a map", Code.MALFORMED_FRAME);
  }
  if (typeof m.type !== "string") throw new ProtocolError("frame body has no str type", Code.MALFORMED_FRAME);
  return m;
}

/**
 * The 4-byte big-endian length prefix followed by the body.
 * @param {Uint8Array} body
 * @returns {Uint8Array}
 */
export function frame(body) {
  const out = new Uint8Array(4 + body.length);
  new DataView(out.buffer).setUint32(0, body.length);
  out.set(body, 4);
  return out;
}

/**
 * The body of one whole frame (a WebSocket message or a DATA payload).
 * @param {Uint8Array} message
 * @param {number} maxFrame
 * @returns {Uint8Array}
 */
export function unframe(message, maxFrame) {
  if (message.length < 4) throw new ProtocolError("message shorter than a frame header", Code.MALFORMED_FRAME);
  const length = new DataView(message.buffer, message.byteOffset, 4).getUint32(0);
  if (length > maxFrame) throw new ProtocolError(`frame of ${length} bytes exceeds ${maxFrame}`, Code.FRAME_TOO_LARGE);
  if (length === 0 || length !== message.length - 4) {
    throw new ProtocolError(`frame header says ${length} bytes, message holds ${message.length - 4}`,
      Code.MALFORMED_FRAME);
  }
  return message.subarray(4);
}

/**
 * A relay envelope: kind u8, stream u32 big-endian, payload.
 * @param {number} kind
 * @param {number} stream
 * @param {Uint8Array} [payload]
 * @returns {Uint8Array}
 */
export function packEnvelope(kind, stream, payload = new Uint8Array(0)) {
  const out = new Uint8Array(5 + payload.length);
  out[0] = kind;
  new DataView(out.buffer).setUint32(1, stream);
  out.set(payload, 5);
  return out;
}

/**
 * @param {Uint8Array} data
 * @returns {{kind: number, stream: number, payload: Uint8Array}}
 */
export function unpackEnvelope(data) {
  if (data.length < 5) throw new ProtocolError("envelope shorter than 5 bytes", Code.MALFORMED_FRAME);
  const kind = data[0];
  if (kind > 3) throw new ProtocolError(`unknown envelope kind ${kind}`, Code.MALFORMED_FRAME);
  const stream = new DataView(data.buffer, data.byteOffset + 1, 4).getUint32(0);
  if ((kind === Kind.CONTROL) !== (stream === 0)) {
    throw new ProtocolError("stream 0 is for CONTROL envelopes only", Code.MALFORMED_FRAME);
  }
  return { kind, stream, payload: data.subarray(5) };
}

/** @param {Uint8Array} bytes @returns {string} */
export function toHex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

/** @param {string} hex @returns {Uint8Array} */
export function fromHex(hex) {
  if (hex.length % 2) throw new Error("odd hex length");
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

/** @param {...Uint8Array} parts @returns {Uint8Array} */
export function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** @param {Uint8Array} a @param {Uint8Array} b @returns {boolean} */
export function equalBytes(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}
