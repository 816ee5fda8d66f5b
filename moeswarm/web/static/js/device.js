// A device session with a relay (protocol_spec/relay.md): authenticate over CONTROL envelopes,
// publish the signed announcement, and run a data-plane server (README sections 8-12) on every
// stream the relay opens. The browser's counterpart of mobile_bridge/link.py + bridge.py.

import {
  Code, Kind, ProtocolError, canonical, decodeBody, frame, packEnvelope, unframe, unpackEnvelope, unpackValue,
} from "./wire.js";
import {
  ClientHandshake, ServerHandshake, decodeExpertRequest, decodePing, errorMessage, makeReceipt, signAnnouncement, tensorToWire,
} from "./protocol.js";

export const SOFTWARE = "moeswarm-web/0.1.0";
const FATAL = new Set([Code.MALFORMED_FRAME, Code.UNSUPPORTED_VERSION, Code.FRAME_TOO_LARGE, Code.UNEXPECTED_MESSAGE]);

/** @typedef {import("./identity.js").Identity} Identity */
/** @typedef {import("./experts.js").OnnxShards} OnnxShards */
/** @typedef {import("./protocol.js").ExpertRequest} ExpertRequest */

/**
 * @typedef {object} DeviceOptions
 * @property {string} relayUrl            wss://HOST:PORT of the relay
 * @property {Uint8Array} binding         SHA-256 of the relay's certificate (empty without TLS)
 * @property {number} [maxQueue]          requests waiting for compute before `overloaded` (8)
 * @property {number} [capacityBytes]     announced capacity (a phone announces little)
 * @property {number} [announceIntervalMs]
 * @property {number} [recordTtlMs]
 * @property {number} [maxBackoffMs]
 * @property {(event: string, detail?: any) => void} [onEvent]
 */

/** The stats the page shows. */
export class Stats {
  constructor() {
    this.calls = 0;
    this.pairs = 0;
    this.flops = 0;
    this.errors = 0;
    this.streams = 0;
    this.computeMs = 0;
    /** @type {string[]} canonical hex of the last receipts */
    this.receipts = [];
  }
}

class Stream {
  /** @param {RelayDevice} device @param {Session} session @param {number} id */
  constructor(device, session, id) {
    this.device = device;
    this.session = session;
    this.id = id;
    this.hs = new ServerHandshake(device.identity);
    /** @type {Uint8Array | null} */
    this.client = null;
    this.closed = false;
    /** @type {Promise<void>} */
    this.chain = Promise.resolve();
  }

  /** @param {Record<string, any>} msg */
  send(msg) {
    if (!this.closed) this.session.send(packEnvelope(Kind.DATA, this.id, frame(canonical(msg))));
  }

  close() {
    if (this.closed) return;
    this.closed = true;
    this.session.send(packEnvelope(Kind.CLOSE, this.id, canonical({ code: 0, message: "" })));
    this.session.streams.delete(this.id);
  }

  /** @param {Uint8Array} data one frame, length prefix included */
  feed(data) {
    this.chain = this.chain.then(() => this.#handle(data)).catch((e) => {
      const code = e instanceof ProtocolError ? e.code : Code.INTERNAL;
      this.send(errorMessage(code, String(e.message ?? e), e.requestId));
      if (FATAL.has(code) || (code === Code.AUTH_FAILED && this.client === null)) this.close();
    });
  }

  /** @param {Uint8Array} data */
  async #handle(data) {
    if (this.closed) return;
    const body = unframe(data, this.session.maxFrame);
    const m = decodeBody(body);
    if (this.client === null) {
      if (m.type === "hello") this.send(await this.hs.receiveHello(m));
      else if (m.type === "auth") this.client = await this.hs.receiveAuth(m);
      else if (m.type !== "error") throw new ProtocolError(`${m.type} before the handshake`, Code.UNEXPECTED_MESSAGE);
      return;
    }
    switch (m.type) {
      case "ping": {
        const ping = decodePing(m);
        this.send({ type: "pong", ts: ping.ts, pad: ping.want ? new Uint8Array(ping.want) : undefined });
        break;
      }
      case "expert_request": {
        const raw = m.request_id instanceof Uint8Array && m.request_id.length === 16 ? m.request_id : undefined;
        let request;
        try {
          request = decodeExpertRequest(m);
        } catch (e) {
          if (e instanceof ProtocolError) e.requestId = raw;
          throw e;
        }
        this.device.serve(this, request).catch((e) => {
          const code = e instanceof ProtocolError ? e.code : Code.INTERNAL;
          this.device.stats.errors++;
          this.send(errorMessage(code, String(e.message ?? e), request.request_id));
        });
        break;
      }
      case "error":
      case "pong":
        break;
      case "hello":
      case "auth":
        throw new ProtocolError(`a second ${m.type}`, Code.UNEXPECTED_MESSAGE);
      default:
        throw new ProtocolError(`unknown message type ${m.type}`, Code.UNKNOWN_MESSAGE);
    }
  }
}

class Session {
  /** @param {WebSocket} ws */
  constructor(ws) {
    this.ws = ws;
    /** @type {Map<number, Stream>} */
    this.streams = new Map();
    this.maxFrame = 64 << 20;
    this.endpoint = "";
  }

  /** @param {Uint8Array} data */
  send(data) {
    if (this.ws.readyState === WebSocket.OPEN) this.ws.send(data);
  }
}

export class RelayDevice {
  /** @param {Identity} identity @param {OnnxShards} shards @param {DeviceOptions} options */
  constructor(identity, shards, options) {
    this.identity = identity;
    this.shards = shards;
    this.options = { maxQueue: 64, announceIntervalMs: 240_000, recordTtlMs: 600_000, maxBackoffMs: 30_000,
      capacityBytes: shards.fileBytes, onEvent: () => {}, ...options };
    this.stats = new Stats();
    /** @type {Session | null} */
    this.session = null;
    this.stopped = false;
    this.seq = Date.now();
    /** @type {Map<string, Set<number>>} client -> seqs receipted */
    this.receipted = new Map();
    /** @type {ReturnType<typeof setTimeout> | undefined} */
    this.timer = undefined;
    this.endpoint = "";
  }

  /** @param {string} event @param {any} [detail] */
  emit(event, detail) {
    this.options.onEvent(event, detail);
  }

  /** Keep a session open until stop(), reconnecting with jittered exponential backoff (relay.md section 5). */
  async run() {
    let delay = 500;
    while (!this.stopped) {
      let retryAfter = null;
      let welcomed = false;
      try {
        const result = await this.#oneSession(() => { welcomed = true; });
        retryAfter = result;
      } catch (e) {
        this.emit("error", String(/** @type {Error} */ (e).message ?? e));
      }
      if (this.stopped) break;
      if (welcomed) delay = 500;
      const wait = retryAfter ?? Math.random() * delay;
      delay = Math.min(this.options.maxBackoffMs, delay * 2);
      this.emit("reconnecting", wait);
      await new Promise((resolve) => { this.timer = setTimeout(resolve, wait); });
    }
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.session) {
      for (const stream of [...this.session.streams.values()]) stream.close();
      this.session.ws.close(1000, "volunteer stopped");  // its onclose reports "stopped"
    } else this.emit("stopped");
  }

  /** @param {() => void} onWelcome @returns {Promise<number | null>} the relay's retry delay, if it said goodbye */
  #oneSession(onWelcome) {
    const url = this.options.relayUrl.replace(/\/$/, "") + "/device";
    const ws = new WebSocket(url, "moeswarm-relay.v1");
    ws.binaryType = "arraybuffer";
    const session = new Session(ws);
    const hs = new ClientHandshake(this.identity, this.options.binding);
    /** @type {number | null} */
    let goaway = null;
    let state = "hello";
    return new Promise((resolve, reject) => {
      const fail = (/** @type {unknown} */ e) => {
        ws.close(1002);
        reject(e);
      };
      ws.onopen = () => ws.send(packEnvelope(Kind.CONTROL, 0, canonical(hs.hello)));
      ws.onclose = (ev) => {
        this.session = null;
        clearInterval(this.announcer);
        this.emit(this.stopped ? "stopped" : "disconnected", `${ev.code} ${ev.reason}`);
        if (state !== "open") reject(new Error(`relay closed the session during the handshake (${ev.code} ${ev.reason})`));
        else resolve(goaway);
      };
      ws.onmessage = async (ev) => {
        if (!(ev.data instanceof ArrayBuffer)) return fail(new ProtocolError("relay sent a text message", Code.MALFORMED_FRAME));
        try {
          const { kind, stream, payload } = unpackEnvelope(new Uint8Array(ev.data));
          if (kind === Kind.CONTROL) {
            const m = decodeBody(payload);
            if (m.type === "error") throw new ProtocolError(`relay refused: ${m.message}`, m.code);
            if (state === "hello") {
              state = "auth";
              ws.send(packEnvelope(Kind.CONTROL, 0, canonical(await hs.receiveAck(m))));
            } else if (state === "auth") {
              if (m.type !== "relay_welcome") throw new ProtocolError("relay did not welcome us", Code.UNEXPECTED_MESSAGE);
              state = "open";
              session.maxFrame = m.max_frame;
              session.endpoint = this.endpoint = m.endpoint;
              this.session = session;
              onWelcome();
              this.emit("welcome", m.endpoint);
              this.#publish(session);
              this.announcer = setInterval(() => this.#publish(session), this.options.announceIntervalMs);
            } else this.#control(m);
          } else if (state !== "open") {
            throw new ProtocolError("stream envelope before the welcome", Code.UNEXPECTED_MESSAGE);
          } else if (kind === Kind.OPEN) {
            if (session.streams.has(stream)) throw new ProtocolError(`relay reopened stream ${stream}`, Code.UNEXPECTED_MESSAGE);
            session.streams.set(stream, new Stream(this, session, stream));
            this.stats.streams++;
          } else if (kind === Kind.DATA) {
            session.streams.get(stream)?.feed(payload.slice());
          } else if (kind === Kind.CLOSE) {
            const s = session.streams.get(stream);
            if (s) {
              s.closed = true;
              session.streams.delete(stream);
            }
          }
        } catch (e) {
          if (state !== "open") fail(e);
          else this.emit("error", String(/** @type {Error} */ (e).message ?? e));
        }
      };
      /** @param {Record<string, any>} m */
      this.#control = (m) => {
        if (m.type === "relay_published") this.emit("published", m.seq);
        else if (m.type === "relay_goaway") {
          goaway = (m.retry_after_ms ?? 1000) * (1 + Math.random() / 2);
          this.emit("goaway", m.reason);
        }
      };
    });
  }

  /** @type {(m: Record<string, any>) => void} */
  #control = () => {};

  /** @type {ReturnType<typeof setInterval> | undefined} */
  announcer = undefined;

  /** @param {Session} session */
  async #publish(session) {
    const m = this.shards.manifest;
    const layers = this.shards.moeLayers;
    const served = this.shards.served(layers[0]);
    this.seq = Math.max(this.seq + 1, Date.now());
    const record = await signAnnouncement(this.identity, {
      model_id: m.model_id, layers: [layers[0], layers[layers.length - 1]], experts: [served[0], served[served.length - 1]],
      endpoints: [session.endpoint], capacity_bytes: this.options.capacityBytes, throughput: this.throughput(),
      load_permille: Math.min(1000, Math.round(1000 * this.shards.pending / this.options.maxQueue)),
      software: SOFTWARE, seq: this.seq, expires_at_ms: Date.now() + this.options.recordTtlMs,
    });
    session.send(packEnvelope(Kind.CONTROL, 0, canonical({ type: "relay_publish", record, layers })));
  }

  /** @returns {number} pairs per second measured so far */
  throughput() {
    return this.stats.computeMs > 0 ? Math.round(1000 * this.stats.pairs / this.stats.computeMs) : 0;
  }

  /**
   * Server-side checks, compute, receipt (README section 9 / relay.md section 9 item 5).
   * @param {Stream} stream
   * @param {ExpertRequest} request
   */
  async serve(stream, request) {
    const arrived = performance.now();
    const m = this.shards.manifest;
    const H = m.hidden_size;
    if (request.model_id !== m.model_id) throw new ProtocolError(`model ${request.model_id} is not served here`, Code.UNKNOWN_EXPERT);
    const served = this.shards.served(request.layer);
    if (!served.length) throw new ProtocolError(`layer ${request.layer} is not served here`, Code.UNKNOWN_EXPERT);
    const missing = request.experts.filter((e) => !served.includes(e.expert)).map((e) => e.expert);
    if (missing.length) throw new ProtocolError(`experts ${missing} of layer ${request.layer} are not served here`, Code.UNKNOWN_EXPERT);
    if (request.hidden.shape[1] !== H) throw new ProtocolError(`hidden must be (N, ${H})`, Code.BAD_TENSOR);
    const key = Array.from(/** @type {Uint8Array} */ (stream.client)).join(",");
    const seen = this.receipted.get(key) ?? new Set();
    if (seen.has(request.seq)) throw new ProtocolError(`seq ${request.seq} was already receipted`, Code.STALE);
    if (this.shards.pending >= this.options.maxQueue) throw new ProtocolError("expert queue is full", Code.OVERLOADED);
    const inputs = new Map();
    for (const e of request.experts) {
      const x = new Float32Array(e.indices.length * H);
      e.indices.forEach((row, k) => x.set(request.hidden.values.subarray(row * H, (row + 1) * H), k * H));
      inputs.set(e.expert, x);
    }
    const deadline = request.deadline_ms === undefined ? Infinity : arrived + request.deadline_ms;
    /** @type {number} */
    let started = 0;
    const results = await this.shards.run(request.layer, inputs, () => {
      started = performance.now();
      if (started > deadline) throw new ProtocolError("deadline passed before compute", Code.DEADLINE_EXCEEDED);
    });
    const t1 = performance.now();
    const waitStart = started;
    const values = new Float32Array(request.pairs * H);
    let at = 0;
    for (const e of request.experts) {
      const y = /** @type {Float32Array} */ (results.get(e.expert));
      values.set(y, at);
      at += y.length;
    }
    const outputs = tensorToWire(values, [request.pairs, H], request.hidden.dtype);
    if (outputs === null) throw new ProtocolError(`the outputs overflow ${request.hidden.dtype}`, Code.NON_FINITE);
    const expertFlops = request.pairs * 6 * H * m.intermediate_size;
    const receipt = await makeReceipt(this.identity, request, outputs,
      { client: /** @type {Uint8Array} */ (stream.client), expertFlops, timeMs: Date.now() });
    seen.add(request.seq);
    if (seen.size > 4096) seen.delete(seen.values().next().value);
    this.receipted.set(key, seen);
    const computeUs = Math.round((t1 - waitStart) * 1000);
    stream.send({ type: "expert_response", request_id: request.request_id, outputs, receipt, compute_us: computeUs,
      load_permille: Math.min(1000, Math.round(1000 * this.shards.pending / this.options.maxQueue)) });
    this.stats.calls++;
    this.stats.pairs += request.pairs;
    this.stats.flops += expertFlops;
    this.stats.computeMs += t1 - waitStart;
    this.stats.receipts.push(Array.from(canonical(receipt), (b) => b.toString(16).padStart(2, "0")).join(""));
    if (this.stats.receipts.length > 256) this.stats.receipts.shift();
    this.emit("served", request);
  }
}

export { unpackValue };
