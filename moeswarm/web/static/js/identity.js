// Ed25519 identity with WebCrypto (README section 2 and 4): peer IDs, base58btc, domain-separated signatures.

import { ProtocolError, Code, concat, equalBytes } from "./wire.js";

const subtle = globalThis.crypto.subtle;
const ED25519 = { name: "Ed25519" };
const PEER_PREFIX = Uint8Array.of(0x00, 0x24, 0x08, 0x01, 0x12, 0x20);
const PKCS8_PREFIX = Uint8Array.of(0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20);
const ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz";
const text = new TextEncoder();

/**
 * @typedef {object} Identity
 * @property {CryptoKey} privateKey  non-extractable where the platform allows
 * @property {Uint8Array} publicKey  32 bytes
 * @property {Uint8Array} peerId     38 bytes
 * @property {string} peerIdStr      base58btc
 */

/** @param {Uint8Array} publicKey @returns {Uint8Array} */
export function peerIdFromPublicKey(publicKey) {
  if (publicKey.length !== 32) throw new ProtocolError("public key must be 32 bytes", Code.BAD_FIELD);
  return concat(PEER_PREFIX, publicKey);
}

/** @param {unknown} value @returns {boolean} */
export function isPeerId(value) {
  return value instanceof Uint8Array && value.length === 38 && equalBytes(value.subarray(0, 6), PEER_PREFIX);
}

/** @param {Uint8Array} peerId @returns {Uint8Array} */
export function publicKeyFromPeerId(peerId) {
  if (!isPeerId(peerId)) throw new ProtocolError("not an Ed25519 peer ID", Code.BAD_FIELD);
  return peerId.slice(6);
}

/** @param {Uint8Array} bytes @returns {string} */
export function base58(bytes) {
  let n = 0n;
  for (const b of bytes) n = n * 256n + BigInt(b);
  let out = "";
  while (n > 0n) {
    out = ALPHABET[Number(n % 58n)] + out;
    n /= 58n;
  }
  for (const b of bytes) {
    if (b !== 0) break;
    out = "1" + out;
  }
  return out;
}

/** @param {CryptoKeyPair} pair @returns {Promise<Identity>} */
async function fromPair(pair) {
  const publicKey = new Uint8Array(await subtle.exportKey("raw", pair.publicKey));
  const peerId = peerIdFromPublicKey(publicKey);
  return { privateKey: pair.privateKey, publicKey, peerId, peerIdStr: base58(peerId) };
}

/**
 * A fresh identity; the private key cannot be exported (`extractable` false) unless asked.
 * @param {boolean} [extractable]
 * @returns {Promise<Identity>}
 */
export async function generateIdentity(extractable = false) {
  const pair = /** @type {CryptoKeyPair} */ (await subtle.generateKey(ED25519, extractable, ["sign", "verify"]));
  return fromPair(pair);
}

/**
 * The identity of a 32-byte RFC 8032 seed (tests and vectors).
 * @param {Uint8Array} seed
 * @returns {Promise<Identity>}
 */
export async function identityFromSeed(seed) {
  const privateKey = await subtle.importKey("pkcs8", concat(PKCS8_PREFIX, seed), ED25519, true, ["sign"]);
  const jwk = await subtle.exportKey("jwk", privateKey);
  const publicKey = Uint8Array.from(atob(String(jwk.x).replace(/-/g, "+").replace(/_/g, "/")), (c) => c.charCodeAt(0));
  const peerId = peerIdFromPublicKey(publicKey);
  return { privateKey, publicKey, peerId, peerIdStr: base58(peerId) };
}

/**
 * The restored identity of a stored private key and public key (IndexedDB keeps CryptoKeys as they are).
 * @param {CryptoKey} privateKey
 * @param {Uint8Array} publicKey
 * @returns {Identity}
 */
export function identityFromKeys(privateKey, publicKey) {
  const peerId = peerIdFromPublicKey(publicKey);
  return { privateKey, publicKey, peerId, peerIdStr: base58(peerId) };
}

/** @param {string} kind @param {Uint8Array} payload @returns {Uint8Array} */
export function signedBytes(kind, payload) {
  return concat(text.encode(`moeswarm/v1/${kind}`), Uint8Array.of(0), payload);
}

/**
 * Ed25519 over "moeswarm/v1/" || kind || 0x00 || payload.
 * @param {Identity} identity
 * @param {string} kind
 * @param {Uint8Array} payload
 * @returns {Promise<Uint8Array>}
 */
export async function sign(identity, kind, payload) {
  return new Uint8Array(await subtle.sign(ED25519, identity.privateKey, signedBytes(kind, payload)));
}

/**
 * @param {Uint8Array} publicKey
 * @param {string} kind
 * @param {Uint8Array} payload
 * @param {Uint8Array} sig
 * @returns {Promise<boolean>}
 */
export async function verify(publicKey, kind, payload, sig) {
  if (!(sig instanceof Uint8Array) || sig.length !== 64) return false;
  try {
    const key = await subtle.importKey("raw", publicKey, ED25519, false, ["verify"]);
    return await subtle.verify(ED25519, key, sig, signedBytes(kind, payload));
  } catch {
    return false; // a key that does not decode to a curve point
  }
}

/** @param {Uint8Array} data @returns {Promise<Uint8Array>} */
export async function sha256(data) {
  return new Uint8Array(await subtle.digest("SHA-256", data));
}
