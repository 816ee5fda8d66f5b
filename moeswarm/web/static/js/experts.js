// The ONNX expert shards of `moeswarm export-onnx`, downloaded, checked against manifest.json's
// SHA-256 digests, and run with onnxruntime-web (WebAssembly SIMD, one thread): the browser's
// counterpart of moeswarm/mobile_bridge/shards.py. relay.md section 9: one run per layer, inputs
// x_<e>, outputs y_<e>, each (n_e, H); branches not needed get zero rows.

import { sha256 } from "./identity.js";
import { toHex } from "./wire.js";

/**
 * @typedef {object} Manifest
 * @property {string} format
 * @property {string} model_id
 * @property {string} dtype
 * @property {number} hidden_size
 * @property {number} intermediate_size
 * @property {number[]} layers
 * @property {number[]} experts
 * @property {{layer: number, experts: number[], file: string, data: string, sha256: Record<string, string>}[]} shards
 * @property {Record<string, string>} files
 */

const FORMAT = "moeswarm-onnx-shards/1";

/**
 * GET a file and check its SHA-256 against the manifest before anything uses it.
 * @param {string} base
 * @param {string} name
 * @param {string} digest hex
 * @returns {Promise<Uint8Array>}
 */
async function fetchChecked(base, name, digest) {
  const response = await fetch(new URL(name, base));
  if (!response.ok) throw new Error(`GET ${name}: HTTP ${response.status}`);
  const bytes = new Uint8Array(await response.arrayBuffer());
  const got = toHex(await sha256(bytes));
  if (got !== digest) throw new Error(`${name} does not match the SHA-256 in manifest.json (got ${got})`);
  return bytes;
}

export class OnnxShards {
  /**
   * @param {any} ort the onnxruntime-web module
   * @param {Manifest} manifest
   * @param {Map<number, any>} sessions layer -> InferenceSession
   * @param {Map<number, {all: number[], served: number[]}>} held layer -> experts in the file and served
   * @param {number} fileBytes
   */
  constructor(ort, manifest, sessions, held, fileBytes) {
    this.ort = ort;
    this.manifest = manifest;
    this.sessions = sessions;
    this.held = held;
    this.fileBytes = fileBytes;
    /** @type {Promise<unknown>} */
    this.queue = Promise.resolve();
    this.pending = 0;
  }

  /**
   * Download and open the shards under `base` (a folder URL ending in "/"), within the ranges asked.
   * @param {any} ort
   * @param {string} base
   * @param {{layers?: number[], experts?: number[], onProgress?: (message: string) => void}} [options]
   * @returns {Promise<OnnxShards>}
   */
  static async load(ort, base, options = {}) {
    const say = options.onProgress ?? (() => {});
    const response = await fetch(new URL("manifest.json", base));
    if (!response.ok) throw new Error(`GET manifest.json: HTTP ${response.status}`);
    /** @type {Manifest} */
    const manifest = await response.json();
    if (manifest.format !== FORMAT) throw new Error(`manifest format ${manifest.format} is not ${FORMAT}`);
    if (manifest.dtype !== "fp32") throw new Error(`shards of dtype ${manifest.dtype}: this page runs fp32 shards`);
    const layers = options.layers ?? manifest.layers;
    const experts = options.experts ?? manifest.experts;
    if (!(manifest.layers[0] <= layers[0] && layers[0] <= layers[1] && layers[1] <= manifest.layers[1]) ||
        !(manifest.experts[0] <= experts[0] && experts[0] <= experts[1] && experts[1] <= manifest.experts[1])) {
      throw new Error(`asked for layers ${layers} experts ${experts}, the shards hold ${manifest.layers} / ${manifest.experts}`);
    }
    for (const [name, digest] of Object.entries(manifest.files ?? {})) await fetchChecked(base, name, digest);
    const sessions = new Map();
    const held = new Map();
    let fileBytes = 0;
    for (const shard of manifest.shards) {
      if (shard.layer < layers[0] || shard.layer > layers[1]) continue;
      say(`downloading layer ${shard.layer}`);
      const graph = await fetchChecked(base, shard.file, shard.sha256[shard.file]);
      const data = await fetchChecked(base, shard.data, shard.sha256[shard.data]);
      fileBytes += data.length;
      const session = await ort.InferenceSession.create(graph, {
        executionProviders: ["wasm"], intraOpNumThreads: 1, interOpNumThreads: 1, executionMode: "sequential",
        externalData: [{ path: shard.data, data }], graphOptimizationLevel: "all",
        extra: { session: { "intra_op.allow_spinning": "0", "inter_op.allow_spinning": "0" } },
      });
      sessions.set(shard.layer, session);
      const ids = [];
      for (let e = Math.max(shard.experts[0], experts[0]); e <= Math.min(shard.experts[1], experts[1]); e++) ids.push(e);
      held.set(shard.layer, { all: shard.experts, served: ids });
    }
    if (!sessions.size) throw new Error(`no shard lies in layers ${layers}`);
    say(`holding ${sessions.size} layers`);
    return new OnnxShards(ort, manifest, sessions, held, fileBytes);
  }

  /** @returns {number[]} */
  get moeLayers() {
    return [...this.sessions.keys()].sort((a, b) => a - b);
  }

  /** @param {number} layer @returns {number[]} expert ids served in the layer */
  served(layer) {
    return this.held.get(layer)?.served ?? [];
  }

  /**
   * Compute experts of one layer: `inputs` maps expert -> (n_e * H) float32 rows. Runs one at a
   * time (a session cannot run twice at once); resolves to expert -> (n_e * H) outputs.
   * @param {number} layer
   * @param {Map<number, Float32Array>} inputs
   * @param {() => void} [onStart] called when the run starts; it may throw to cancel it (deadlines)
   * @returns {Promise<Map<number, Float32Array>>}
   */
  run(layer, inputs, onStart = () => {}) {
    this.pending++;
    const result = this.queue.then(() => {
      onStart();
      return this.#run(layer, inputs);
    });
    this.queue = result.catch(() => {}).finally(() => { this.pending--; });
    return result;
  }

  /** @param {number} layer @param {Map<number, Float32Array>} inputs */
  async #run(layer, inputs) {
    const { ort, manifest } = this;
    const H = manifest.hidden_size;
    const session = this.sessions.get(layer);
    const [first, last] = this.held.get(layer).all;
    /** @type {Record<string, any>} */
    const feeds = {};
    for (let e = first; e <= last; e++) {
      const x = inputs.get(e) ?? new Float32Array(0);
      feeds[`x_${e}`] = new ort.Tensor("float32", x, [x.length / H, H]);
    }
    const wanted = [...inputs.keys()];
    const out = await session.run(feeds, wanted.map((e) => `y_${e}`));
    return new Map(wanted.map((e) => [e, /** @type {Float32Array} */ (out[`y_${e}`].data)]));
  }
}
