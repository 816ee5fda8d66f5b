// The data-plane messages a device needs (README sections 7-13): handshake both ways, tensors,
// expert_request validation, hashes, signed receipts and announcements. No I/O here.

import { Code, ProtocolError, canonical, concat, equalBytes } from "./wire.js";
import { isPeerId, peerIdFromPublicKey, sha256, sign, verify } from "./identity.js";

export const VERSIONS = [1];
const U32 = 2 ** 32 - 1;
const MODEL_ID = /^[A-Za-z0-9._@+-]+(\/[A-Za-z0-9._@+-]+)*$/;

/** @typedef {import("./identity.js").Identity} Identity */

/** @param {string} message @param {number} [code] @returns {never} */
function bad(message, code = Code.BAD_FIELD) {
  throw new ProtocolError(message, code);
}

/** @param {unknown} v @returns {v is number} */
function isUint(v) {
  return typeof v === "number" && Number.isInteger(v) && v >= 0;
}

/** @param {Record<string, any>} m @param {string} name @param {number} [hi] @returns {number} */
function uint(m, name, hi = Number.MAX_SAFE_INTEGER) {
  const v = m[name];
  if (!isUint(v) || v > hi) bad(`${m.type ?? "field"}.${name} is missing, not a uint or out of range`);
  return v;
}

/** @param {Record<string, any>} m @param {string} name @param {number} [size] @returns {Uint8Array} */
function bin(m, name, size) {
  const v = m[name];
  if (!(v instanceof Uint8Array) || (size !== undefined && v.length !== size)) {
    bad(`${m.type ?? "field"}.${name} must be bin${size === undefined ? "" : `[${size}]`}`);
  }
  return v;
}

/** @param {Record<string, any>} m @param {string} name @returns {Uint8Array} */
function peer(m, name) {
  const v = m[name];
  if (!isPeerId(v)) bad(`${m.type}.${name} is not an Ed25519 peer ID`);
  return v;
}

// ---------------------------------------------------------------- handshake (section 8)

/**
 * @param {{role: string, version: number, clientVersions: number[], clientPeer: Uint8Array,
 *   serverPeer: Uint8Array, clientNonce: Uint8Array, serverNonce: Uint8Array, binding: Uint8Array}} t
 * @returns {Uint8Array} canonical transcript
 */
export function transcript(t) {
  return canonical({
    channel_binding: t.binding, client_nonce: t.clientNonce, client_peer: t.clientPeer,
    client_versions: t.clientVersions, role: t.role, server_nonce: t.serverNonce, server_peer: t.serverPeer,
    version: t.version,
  });
}

/** @returns {Uint8Array} */
export function nonce() {
  return globalThis.crypto.getRandomValues(new Uint8Array(32));
}

/** The device as handshake client (towards the relay, with the TLS channel binding). */
export class ClientHandshake {
  /** @param {Identity} identity @param {Uint8Array} binding @param {Uint8Array | null} [expectedServer] */
  constructor(identity, binding, expectedServer = null) {
    this.identity = identity;
    this.binding = binding;
    this.expectedServer = expectedServer;
    this.hello = { type: "hello", versions: VERSIONS, peer_id: identity.peerId, public_key: identity.publicKey,
      nonce: nonce() };
    /** @type {Uint8Array | null} */
    this.serverPeer = null;
  }

  /** @param {Record<string, any>} ack @returns {Promise<Record<string, any>>} the auth message */
  async receiveAck(ack) {
    if (ack.type !== "hello_ack") bad(`expected hello_ack, got ${ack.type}`, Code.UNEXPECTED_MESSAGE);
    const version = uint(ack, "version", 0xffff);
    if (!VERSIONS.includes(version)) bad(`server chose version ${version}`, Code.UNSUPPORTED_VERSION);
    const serverPeer = peer(ack, "peer_id");
    const publicKey = bin(ack, "public_key", 32);
    const serverNonce = bin(ack, "nonce", 32);
    const sig = bin(ack, "sig", 64);
    if (!equalBytes(peerIdFromPublicKey(publicKey), serverPeer)) bad("server key does not derive its peer ID", Code.AUTH_FAILED);
    if (this.expectedServer && !equalBytes(serverPeer, this.expectedServer)) bad("unexpected server peer", Code.AUTH_FAILED);
    if (equalBytes(serverNonce, this.hello.nonce)) bad("server echoed our nonce", Code.AUTH_FAILED);
    const t = { version, clientVersions: VERSIONS, clientPeer: this.identity.peerId, serverPeer,
      clientNonce: this.hello.nonce, serverNonce, binding: this.binding };
    if (!await verify(publicKey, "auth", transcript({ ...t, role: "server" }), sig)) {
      bad("server's handshake signature does not verify", Code.AUTH_FAILED);
    }
    this.serverPeer = serverPeer;
    return { type: "auth", sig: await sign(this.identity, "auth", transcript({ ...t, role: "client" })) };
  }
}

/** The device as handshake server (on every relayed stream, empty channel binding). */
export class ServerHandshake {
  /** @param {Identity} identity @param {Uint8Array} [binding] */
  constructor(identity, binding = new Uint8Array(0)) {
    this.identity = identity;
    this.binding = binding;
    this.nonce = nonce();
    /** @type {Record<string, any> | null} */
    this.hello = null;
    this.version = 0;
    /** @type {Uint8Array | null} */
    this.clientPeer = null;
  }

  /** @param {Record<string, any>} hello @returns {Promise<Record<string, any>>} the hello_ack */
  async receiveHello(hello) {
    if (this.hello !== null) bad("second hello", Code.UNEXPECTED_MESSAGE);
    const h = decodeHello(hello);
    const common = h.versions.filter((/** @type {number} */ v) => VERSIONS.includes(v));
    if (!common.length) bad(`no common version: server speaks ${VERSIONS}`, Code.UNSUPPORTED_VERSION);
    if (!equalBytes(peerIdFromPublicKey(h.public_key), h.peer_id)) bad("client key does not derive its peer ID", Code.AUTH_FAILED);
    if (equalBytes(h.nonce, this.nonce)) bad("client echoed the server's nonce", Code.AUTH_FAILED);
    this.hello = h;
    this.version = Math.max(...common);
    const sig = await sign(this.identity, "auth", this.#transcript("server"));
    return { type: "hello_ack", version: this.version, peer_id: this.identity.peerId,
      public_key: this.identity.publicKey, nonce: this.nonce, sig };
  }

  /** @param {Record<string, any>} auth @returns {Promise<Uint8Array>} the authenticated client peer */
  async receiveAuth(auth) {
    if (this.hello === null || this.clientPeer !== null) bad("auth out of order", Code.UNEXPECTED_MESSAGE);
    const hello = /** @type {Record<string, any>} */ (this.hello);
    if (!await verify(hello.public_key, "auth", this.#transcript("client"), bin(auth, "sig", 64))) {
      bad("client's handshake signature does not verify", Code.AUTH_FAILED);
    }
    this.clientPeer = hello.peer_id;
    return hello.peer_id;
  }

  /** @param {string} role */
  #transcript(role) {
    const h = /** @type {Record<string, any>} */ (this.hello);
    return transcript({ role, version: this.version, clientVersions: h.versions, clientPeer: h.peer_id,
      serverPeer: this.identity.peerId, clientNonce: h.nonce, serverNonce: this.nonce, binding: this.binding });
  }
}

/**
 * A ping's fields (section 9, v1.1 probes included).
 * @param {Record<string, any>} m
 * @returns {{ts: number, pad: Uint8Array | undefined, want: number}}
 */
export function decodePing(m) {
  const ts = uint(m, "ts");
  const want = m.want === undefined || m.want === null ? 0 : uint(m, "want", 8 << 20);
  const pad = m.pad === undefined || m.pad === null ? undefined : bin(m, "pad");
  if (pad && pad.length > 8 << 20) bad("ping.pad above 8 MiB");
  return { ts, pad, want };
}

/**
 * The codec's checks of a hello (section 8).
 * @param {Record<string, any>} hello
 * @returns {{versions: number[], peer_id: Uint8Array, public_key: Uint8Array, nonce: Uint8Array}}
 */
export function decodeHello(hello) {
  const versions = hello.versions;
  if (!Array.isArray(versions) || versions.length < 1 || versions.length > 16 ||
      versions.some((v, i) => !isUint(v) || v < 1 || v > 0xffff || (i > 0 && v <= versions[i - 1]))) {
    bad("hello.versions must be 1..16 ascending u16 >= 1");
  }
  return { versions, peer_id: peer(hello, "peer_id"), public_key: bin(hello, "public_key", 32),
    nonce: bin(hello, "nonce", 32) };
}

// ---------------------------------------------------------------- tensors (section 7)

const ITEM = /** @type {Record<string, number>} */ ({ f32: 4, f16: 2, bf16: 2 });

/** @param {number} h half-precision bits @returns {number} */
function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * f * 2 ** -24;
  if (e === 31) return f ? NaN : s * Infinity;
  return s * (1 + f / 1024) * 2 ** (e - 15);
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** @param {number} x @returns {number} round-to-nearest-even binary16 bits */
function floatToHalf(x) {
  f32[0] = x;
  const bits = u32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant |= 0x800000;
    const shift = 14 - e;
    let half = mant >>> shift;
    const rest = mant & ((1 << shift) - 1);
    const halfway = 1 << (shift - 1);
    if (rest > halfway || (rest === halfway && (half & 1))) half++;
    return sign | half;
  }
  let half = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half++;
  return sign | half;
}

/** @param {number} x @returns {number} round-to-nearest-even bfloat16 bits */
function floatToBf16(x) {
  f32[0] = x;
  const bits = u32[0];
  if ((bits & 0x7f800000) === 0x7f800000) return (bits >>> 16) | ((bits & 0xffff) ? 0x40 : 0);
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
}

/**
 * A validated wire tensor map as float32 values.
 * @param {unknown} obj
 * @param {string} field
 * @param {number} rank
 * @returns {{dtype: string, shape: number[], data: Uint8Array, values: Float32Array, map: Record<string, any>}}
 */
export function tensorFromWire(obj, field, rank) {
  if (obj === null || typeof obj !== "object" || Array.isArray(obj) || obj instanceof Uint8Array) {
    bad(`${field} is not a tensor map`, Code.BAD_TENSOR);
  }
  const m = /** @type {Record<string, any>} */ (obj);
  if (typeof m.dtype !== "string" || !(m.dtype in ITEM)) bad(`${field}.dtype must be f32, f16 or bf16`, Code.BAD_TENSOR);
  if (!Array.isArray(m.shape) || m.shape.length < 1 || m.shape.length > 8 || m.shape.length !== rank) {
    bad(`${field} must have rank ${rank}`, Code.BAD_TENSOR);
  }
  let count = 1;
  for (const d of m.shape) {
    if (!isUint(d) || d > U32) bad(`${field}.shape holds ${d}, not a uint32`, Code.BAD_TENSOR);
    count *= d;
  }
  if (!(m.data instanceof Uint8Array)) bad(`${field}.data is not bin`, Code.BAD_TENSOR);
  if (m.data.length !== count * ITEM[m.dtype]) bad(`${field}.data length does not match its shape`, Code.BAD_TENSOR);
  const view = new DataView(m.data.buffer, m.data.byteOffset, m.data.length);
  const values = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    let v;
    if (m.dtype === "f32") v = view.getFloat32(4 * i, true);
    else if (m.dtype === "f16") v = halfToFloat(view.getUint16(2 * i, true));
    else {
      u32[0] = view.getUint16(2 * i, true) << 16;
      v = f32[0];
    }
    if (!Number.isFinite(v)) bad(`${field} holds NaN or Inf`, Code.NON_FINITE);
    values[i] = v;
  }
  return { dtype: m.dtype, shape: m.shape, data: m.data, values, map: { data: m.data, dtype: m.dtype, shape: m.shape } };
}

/**
 * The wire tensor map of float32 values in `dtype`; null if a value is not finite in that dtype.
 * @param {Float32Array} values
 * @param {number[]} shape
 * @param {string} dtype
 * @returns {Record<string, any> | null}
 */
export function tensorToWire(values, shape, dtype) {
  const data = new Uint8Array(values.length * ITEM[dtype]);
  const view = new DataView(data.buffer);
  for (let i = 0; i < values.length; i++) {
    if (dtype === "f32") {
      if (!Number.isFinite(values[i])) return null;
      view.setFloat32(4 * i, values[i], true);
    } else {
      const bits = dtype === "f16" ? floatToHalf(values[i]) : floatToBf16(values[i]);
      if (((dtype === "f16" ? bits & 0x7c00 : bits & 0x7f80)) === (dtype === "f16" ? 0x7c00 : 0x7f80)) return null;
      view.setUint16(2 * i, bits, true);
    }
  }
  return { data, dtype, shape };
}

// ---------------------------------------------------------------- expert_request (section 9)

/**
 * @typedef {object} ExpertRequest
 * @property {Uint8Array} request_id
 * @property {string} model_id
 * @property {number} layer
 * @property {number} seq
 * @property {ReturnType<typeof tensorFromWire>} hidden
 * @property {{expert: number, rows: Uint8Array, indices: Uint32Array}[]} experts
 * @property {number | undefined} deadline_ms
 * @property {number} pairs
 */

/** @param {Record<string, any>} m @returns {string} */
function modelId(m) {
  const v = m.model_id;
  if (typeof v !== "string" || new TextEncoder().encode(v).length > 128 || !MODEL_ID.test(v)) bad("bad model_id");
  return v;
}

/**
 * Decode and check an expert_request body (the codec's checks; the server's come after).
 * @param {Record<string, any>} m
 * @returns {ExpertRequest}
 */
export function decodeExpertRequest(m) {
  const request_id = bin(m, "request_id", 16);
  const hidden = tensorFromWire(m.hidden, "hidden", 2);
  const [tokens, width] = hidden.shape;
  if (tokens < 1 || width < 1) bad("hidden must be at least 1 x 1", Code.BAD_TENSOR);
  if (!Array.isArray(m.experts) || m.experts.length < 1 || m.experts.length > 65536) bad("experts must hold 1..65536 maps");
  const covered = new Uint8Array(tokens);
  const seen = new Set();
  let pairs = 0;
  const experts = m.experts.map((/** @type {any} */ item, /** @type {number} */ i) => {
    if (item === null || typeof item !== "object" || Array.isArray(item)) bad(`experts[${i}] is not a map`);
    const expert = uint(item, "expert", U32);
    if (seen.has(expert)) bad(`expert ${expert} appears twice`);
    seen.add(expert);
    const rows = bin(item, "rows");
    if (rows.length === 0 || rows.length % 4 || rows.length / 4 > tokens) bad(`experts[${i}].rows has a bad length`);
    const view = new DataView(rows.buffer, rows.byteOffset, rows.length);
    const indices = new Uint32Array(rows.length / 4);
    for (let k = 0; k < indices.length; k++) {
      indices[k] = view.getUint32(4 * k, true);
      if (indices[k] >= tokens || (k > 0 && indices[k] <= indices[k - 1])) bad(`experts[${i}].rows must ascend below ${tokens}`);
      covered[indices[k]] = 1;
    }
    pairs += indices.length;
    return { expert, rows, indices };
  });
  if (!covered.every((c) => c === 1)) bad("every row of hidden must be routed to at least one expert");
  const deadline_ms = m.deadline_ms === undefined || m.deadline_ms === null ? undefined : uint(m, "deadline_ms", U32);
  if (deadline_ms === 0) bad("deadline_ms must be >= 1");
  // v1.3's flag (the device answers every request with its own signed receipt, as v1.2 does)
  if (m.signed !== undefined && m.signed !== null && typeof m.signed !== "boolean") bad("signed must be a boolean");
  return { request_id, model_id: modelId(m), layer: uint(m, "layer", U32), seq: uint(m, "seq"), hidden, experts,
    deadline_ms, pairs };
}

// ---------------------------------------------------------------- hashes and receipts (sections 10-11)

/** @param {ExpertRequest} r @returns {Promise<Uint8Array>} */
export function inputHash(r) {
  return sha256(canonical({ experts: r.experts.map((e) => ({ expert: e.expert, rows: e.rows })), hidden: r.hidden.map }));
}

/** @param {Record<string, any>} outputs tensor map @returns {Promise<Uint8Array>} */
export function outputHash(outputs) {
  return sha256(canonical(outputs));
}

/**
 * The receipt fields both signatures cover, in the order canonical() sorts them anyway.
 * @param {Record<string, any>} r
 * @returns {Record<string, any>}
 */
export function receiptBody(r) {
  return { client: r.client, expert_flops: r.expert_flops, experts: r.experts, input_hash: r.input_hash,
    layer: r.layer, model_id: r.model_id, output_hash: r.output_hash, pairs: r.pairs, request_id: r.request_id,
    seq: r.seq, server: r.server, time_ms: r.time_ms, tokens: r.tokens };
}

/**
 * The server's signed receipt for `request` answered with `outputs` (a tensor map).
 * @param {Identity} identity
 * @param {ExpertRequest} request
 * @param {Record<string, any>} outputs
 * @param {{client: Uint8Array, expertFlops: number, timeMs: number}} o
 * @returns {Promise<Record<string, any>>}
 */
export async function makeReceipt(identity, request, outputs, o) {
  const body = receiptBody({ client: o.client, expert_flops: o.expertFlops, experts: request.experts.map((e) => e.expert),
    input_hash: await inputHash(request), layer: request.layer, model_id: request.model_id,
    output_hash: await outputHash(outputs), pairs: request.pairs, request_id: request.request_id, seq: request.seq,
    server: identity.peerId, time_ms: o.timeMs, tokens: request.hidden.shape[0] });
  return { ...body, sig: await sign(identity, "receipt", canonical(body)) };
}

/** @param {Record<string, any>} receipt @returns {Promise<boolean>} */
export function verifyReceipt(receipt) {
  return verify(receipt.server.slice(6), "receipt", canonical(receiptBody(receipt)), receipt.sig);
}

// ---------------------------------------------------------------- announcements (section 13)

/**
 * @param {Identity} identity
 * @param {{model_id: string, layers: number[], experts: number[], endpoints: string[], capacity_bytes: number,
 *   throughput: number, load_permille: number, software: string, seq: number, expires_at_ms: number}} a
 * @returns {Promise<Uint8Array>} the canonical signed record
 */
export async function signAnnouncement(identity, a) {
  const body = { type: "announcement", ...a, peer_id: identity.peerId, public_key: identity.publicKey };
  return canonical({ ...body, sig: await sign(identity, "announcement", canonical(body)) });
}

/** @param {number} code @param {string} message @param {Uint8Array} [requestId] */
export function errorMessage(code, message, requestId) {
  return { type: "error", code, message: message.slice(0, 1000), request_id: requestId };
}

export { concat };
