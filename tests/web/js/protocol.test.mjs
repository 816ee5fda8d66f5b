// node --test: the volunteer page's wire code against protocol_spec/vectors (byte for byte).

import { test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";

import {
  Code, Kind, ProtocolError, canonical, decodeBody, frame, fromHex, packEnvelope, toHex, unframe, unpackEnvelope,
  unpackValue,
} from "../../../moeswarm/web/static/js/wire.js";
import { base58, identityFromSeed, sign, signedBytes, verify, sha256 } from "../../../moeswarm/web/static/js/identity.js";
import {
  ClientHandshake, ServerHandshake, decodeExpertRequest, decodeHello, decodePing, inputHash, makeReceipt, outputHash,
  receiptBody, tensorFromWire, tensorToWire, verifyReceipt,
} from "../../../moeswarm/web/static/js/protocol.js";

const VECTORS = path.join(path.dirname(fileURLToPath(import.meta.url)), "../../../protocol_spec/vectors");

/** Typed JSON (README section 16) -> JS values: {"$bin": hex} -> Uint8Array, integers above 2^53 -> BigInt. */
function load(name) {
  const raw = readFileSync(path.join(VECTORS, name), "utf8").replace(/(?<=[[,:\s])(-?\d{16,})(?=[,\]}\s])/g, '{"$big": "$1"}');
  return JSON.parse(raw, (_, v) => {
    if (v && typeof v === "object" && !Array.isArray(v)) {
      if ("$bin" in v) return fromHex(v.$bin);
      if ("$big" in v) {
        const big = BigInt(v.$big);
        return Number.isSafeInteger(Number(big)) && BigInt(Number(big)) === big ? Number(big) : big;
      }
    }
    return v;
  });
}

/** Decoded msgpack and typed JSON compare equal (bin as bytes). */
function same(a, b) {
  assert.deepEqual(normal(a), normal(b));
}

function normal(v) {
  if (v instanceof Uint8Array) return { bin: toHex(v) };
  if (Array.isArray(v)) return v.map(normal);
  if (v && typeof v === "object") return Object.fromEntries(Object.entries(v).map(([k, x]) => [k, normal(x)]));
  return v;
}

test("canonical.json: every value encodes to its canonical bytes", () => {
  for (const vector of load("canonical.json")) {
    assert.equal(toHex(canonical(vector.value)), vector.canonical_hex, vector.name);
  }
});

const messages = readdirSync(path.join(VECTORS, "messages")).filter((f) => f.endsWith(".json"));

test("messages/*.json: bodies decode to the typed JSON and re-encode byte for byte; frames too", () => {
  assert.ok(messages.length >= 17, `only ${messages.length} message vectors`);
  for (const file of messages) {
    const vector = load(`messages/${file}`);
    const body = fromHex(vector.body_hex);
    const decoded = unpackValue(body);
    same(decoded, vector.wire);
    assert.equal(toHex(canonical(decoded)), vector.body_hex, `${file}: decode then encode`);
    assert.equal(toHex(canonical(vector.wire)), vector.body_hex, `${file}: encode the typed JSON`);
    assert.equal(toHex(frame(body)), vector.frame_hex, `${file}: frame`);
    same(decodeBody(unframe(fromHex(vector.frame_hex), 1 << 20)), vector.wire);
  }
});

test("the device's decoders accept the message vectors they handle", async () => {
  const request = decodeExpertRequest(load("messages/expert_request.json").wire);
  assert.equal(request.pairs, 3);
  assert.deepEqual([...request.hidden.values], [1, -2, 0.5, 0.25, 3, -0.125, 0, 8]);
  assert.deepEqual(request.experts.map((e) => [e.expert, [...e.indices]]), [[1, [0, 1]], [6, [1]]]);
  const bf16 = decodeExpertRequest(load("messages/expert_request_bf16.json").wire);
  assert.equal(bf16.hidden.dtype, "bf16");
  assert.equal(decodePing(load("messages/ping.json").wire).ts, load("messages/ping.json").wire.ts);
  assert.equal(decodePing(load("messages/ping_probe_up.json").wire).want, load("messages/ping_probe_up.json").wire.want ?? 0);
  decodeHello(load("messages/hello.json").wire);
});

test("identity.json: public key, peer ID bytes and base58 from the seed", async () => {
  for (const vector of load("identity.json")) {
    const id = await identityFromSeed(fromHex(vector.seed_hex));
    assert.equal(toHex(id.publicKey), vector.public_key_hex);
    assert.equal(toHex(id.peerId), vector.peer_id_hex);
    assert.equal(base58(id.peerId), vector.peer_id_base58);
  }
});

test("signatures.json: Ed25519 signatures are reproduced and verified; a flipped byte fails", async () => {
  const vectors = load("signatures.json");
  assert.ok(vectors.length >= 4);
  for (const vector of vectors) {
    const id = await identityFromSeed(fromHex(vector.signer_seed_hex));
    const body = canonical(vector.body);
    assert.equal(toHex(body), vector.canonical_body_hex, `${vector.name}: canonical body`);
    assert.equal(id.peerIdStr, vector.signer_peer_id);
    const payload = new Uint8Array([...body, ...fromHex(vector.suffix_hex)]);
    assert.equal(toHex(signedBytes(vector.kind, payload)), vector.signed_bytes_hex, `${vector.name}: signed bytes`);
    const sig = await sign(id, vector.kind, payload);
    assert.equal(toHex(sig), vector.signature_hex, `${vector.name}: signature`);
    assert.ok(await verify(id.publicKey, vector.kind, payload, sig));
    const flipped = sig.slice();
    flipped[7] ^= 1;
    assert.equal(await verify(id.publicKey, vector.kind, payload, flipped), false);
  }
});

test("hashes.json and tensors.json: input/output hashes and tensor maps both ways", async () => {
  const hashes = load("hashes.json");
  const request = decodeExpertRequest(load(`messages/${hashes.request}.json`).wire);
  assert.equal(toHex(await inputHash(request)), hashes.input_hash_hex);
  const response = load("messages/expert_response.json").wire;
  assert.equal(toHex(await outputHash(response.outputs)), hashes.output_hash_hex);
  for (const vector of load("tensors.json")) {
    const t = tensorFromWire({ data: fromHex(vector.data_hex), dtype: vector.dtype, shape: vector.shape }, "t",
      vector.shape.length);
    assert.deepEqual([...t.values].map((x) => Object.is(x, -0) ? "-0" : x),
      vector.values.map((x) => Object.is(x, -0) ? "-0" : Math.fround(x)), vector.name);
    const back = tensorToWire(t.values, vector.shape, vector.dtype);
    assert.equal(toHex(canonical(back)), vector.canonical_hex, vector.name);
    assert.equal(toHex(await sha256(canonical(back))), vector.sha256_hex);
  }
});

test("the receipt of the vector response: re-signed by the server key, byte for byte", async () => {
  const response = load("messages/expert_response.json").wire;
  const server = await identityFromSeed(fromHex(load("identity.json")[1].seed_hex));
  const request = decodeExpertRequest(load("messages/expert_request.json").wire);
  const r = response.receipt;
  const receipt = await makeReceipt(server, request, response.outputs,
    { client: r.client, expertFlops: r.expert_flops, timeMs: r.time_ms });
  assert.equal(toHex(canonical(receipt)), toHex(canonical(r)));
  assert.ok(await verifyReceipt(receipt));
  assert.equal(toHex(canonical(receiptBody(receipt))), toHex(canonical(receiptBody(r))));
  receipt.pairs += 1;
  assert.equal(await verifyReceipt(receipt), false);
});

test("handshake: our client and server sides agree, and the vector hello_ack verifies", async () => {
  const [clientVec, serverVec] = load("identity.json");
  const client = await identityFromSeed(fromHex(clientVec.seed_hex));
  const server = await identityFromSeed(fromHex(serverVec.seed_hex));
  const binding = await sha256(new TextEncoder().encode("moeswarm test vector certificate"));
  const c = new ClientHandshake(client, binding, server.peerId);
  const s = new ServerHandshake(server, binding);
  const ack = await s.receiveHello(unpackValue(canonical(c.hello)));
  const auth = await c.receiveAck(unpackValue(canonical(ack)));
  assert.equal(toHex(await s.receiveAuth(unpackValue(canonical(auth)))), toHex(client.peerId));
  // the vectors' own handshake: the client's hello nonce is 00..1f; the server's hello_ack verifies
  const vc = new ClientHandshake(client, binding, server.peerId);
  vc.hello.nonce = fromHex(load("messages/hello.json").wire.nonce ? toHex(load("messages/hello.json").wire.nonce) : "");
  const vAuth = await vc.receiveAck(load("messages/hello_ack.json").wire);
  assert.equal(toHex(canonical(vAuth)), load("messages/auth.json").body_hex);
  // a server that lies about its key is refused with code 9
  const bad = { ...ack, sig: new Uint8Array(64) };
  await assert.rejects(new ClientHandshake(client, binding).receiveAck(bad), (e) => e.code === Code.AUTH_FAILED);
});

// The device decodes ping, hello and expert_request; the other messages' rules belong to other roles.
const DEVICE_TYPES = /^(ping|hello|expert_request)$/;

test("invalid.json: every body the device decodes is refused with the vector's code", () => {
  let checked = 0;
  for (const vector of load("invalid.json")) {
    if (vector.frame_hex !== undefined) {
      const header = fromHex(vector.frame_hex);
      assert.throws(() => unframe(header.length === 4 ? header : header, vector.max_frame),
        (e) => e instanceof ProtocolError && e.code === vector.code, vector.name);
      checked++;
      continue;
    }
    let body;
    try {
      body = decodeBody(fromHex(vector.body_hex));
    } catch (e) {
      assert.ok(e instanceof ProtocolError, `${vector.name}: ${e}`);
      assert.equal(e.code, vector.code, vector.name);
      checked++;
      continue;
    }
    if (!DEVICE_TYPES.test(body.type)) {
      // messages of other roles, malformed: a device refuses them as unknown before reading their fields
      if (["weights_request", "weights_response", "expert_response", "config_request", "config_response",
        "receipt_batch", "batched_receipt"].includes(body.type)) continue;
      assert.equal(vector.code, Code.UNKNOWN_MESSAGE, `${vector.name}: unknown type ${body.type}`);
      checked++;
      continue;
    }
    const decode = { ping: decodePing, hello: decodeHello, expert_request: decodeExpertRequest }[body.type];
    assert.throws(() => decode(body), (e) => e instanceof ProtocolError && e.code === vector.code, vector.name);
    checked++;
  }
  assert.ok(checked >= 40, `only ${checked} invalid vectors apply to the device`);
});

test("envelopes: kinds, stream ids and the rules of relay.md section 5", () => {
  const e = packEnvelope(Kind.DATA, 7, Uint8Array.of(1, 2));
  assert.equal(toHex(e), "02000000070102");
  assert.deepEqual(unpackEnvelope(e).stream, 7);
  for (const bad of ["0200", "0400000001", "0000000001", "0200000000"]) {
    assert.throws(() => unpackEnvelope(fromHex(bad)), (x) => x.code === Code.MALFORMED_FRAME, bad);
  }
});
