// The volunteer page: identity from IndexedDB, shards from the relay (or any HTTP server), one
// device session; shows what it holds, calls served, credit and a stop button.

import * as ort from "../vendor/onnxruntime-web/ort.wasm.min.mjs";
import { generateIdentity, identityFromKeys } from "./identity.js";
import { OnnxShards } from "./experts.js";
import { RelayDevice } from "./device.js";
import { fromHex } from "./wire.js";

const $ = (/** @type {string} */ id) => /** @type {HTMLElement} */ (document.getElementById(id));

/** @param {string} message */
function log(message) {
  const line = `${new Date().toISOString().slice(11, 19)} ${message}\n`;
  $("log").textContent = (line + ($("log").textContent ?? "")).slice(0, 8000);
}

/** @param {string} text @param {string} [cls] */
function setState(text, cls = "") {
  $("state").textContent = text;
  $("state").className = cls;
  volunteer.state = text;
}

/** @returns {Promise<IDBDatabase>} */
function openDb() {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open("moeswarm-volunteer", 1);
    req.onupgradeneeded = () => req.result.createObjectStore("identity");
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}

/** The device's Ed25519 identity, kept in IndexedDB as a non-extractable CryptoKey. */
async function loadIdentity() {
  const db = await openDb();
  const stored = await new Promise((resolve, reject) => {
    const req = db.transaction("identity").objectStore("identity").get("device");
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
  if (stored) return identityFromKeys(stored.privateKey, new Uint8Array(stored.publicKey));
  const identity = await generateIdentity(false);
  await new Promise((resolve, reject) => {
    const tx = db.transaction("identity", "readwrite");
    tx.objectStore("identity").put({ privateKey: identity.privateKey, publicKey: identity.publicKey }, "device");
    tx.oncomplete = () => resolve(undefined);
    tx.onerror = () => reject(tx.error);
  });
  return identity;
}

/** @param {string | null} text @returns {number[] | undefined} */
function range(text) {
  if (!text) return undefined;
  const [a, b] = text.split("-").map(Number);
  return [a, b ?? a];
}

/** @type {{state: string, device: RelayDevice | null, identity: any, error: string | null, config: any}} */
const volunteer = { state: "starting", device: null, identity: null, error: null, config: null };
/** @type {any} */ (window).volunteer = volunteer;

async function main() {
  const params = new URLSearchParams(location.search);
  const config = await (await fetch("config.json")).json();
  volunteer.config = config;
  ort.env.wasm.wasmPaths = new URL("vendor/onnxruntime-web/", location.href).href;
  ort.env.wasm.numThreads = 1;
  ort.env.wasm.simd = true;
  const identity = await loadIdentity();
  volunteer.identity = identity;
  $("peer").textContent = identity.peerIdStr;
  const shardsAt = params.get("shards") ?? config.shards_url;
  if (!shardsAt) throw new Error("this relay offers no experts to volunteer for (its operator gives --volunteer-shards)");
  const shardsUrl = new URL(shardsAt, location.href).href.replace(/\/?$/, "/");
  setState("downloading experts");
  const shards = await OnnxShards.load(ort, shardsUrl, {
    layers: range(params.get("layers")) ?? config.layers ?? undefined,
    experts: range(params.get("experts")) ?? config.experts ?? undefined, onProgress: log,
  });
  const m = shards.manifest;
  $("holding").textContent = `${m.model_id}: layers ${shards.moeLayers[0]}-${shards.moeLayers.at(-1)}, ` +
    `experts ${shards.served(shards.moeLayers[0]).join(", ")} (${(shards.fileBytes / 2 ** 20).toFixed(1)} MiB, ${m.dtype})`;
  const device = new RelayDevice(identity, shards, {
    relayUrl: params.get("relay") ?? config.relay_url, binding: fromHex(config.binding_hex),
    capacityBytes: config.capacity_bytes ?? shards.fileBytes,
    onEvent: (event, detail) => {
      if (event === "welcome") {
        $("endpoint").textContent = detail;
        setState("connected, waiting for the relay to publish", "up");
      } else if (event === "published") setState("volunteering", "up");
      else if (event === "disconnected") setState("reconnecting", "down");
      else if (event === "stopped") setState("stopped", "down");
      else if (event === "served") {
        const s = device.stats;
        $("calls").textContent = String(s.calls);
        $("pairs").textContent = String(s.pairs);
        $("credit").textContent = (s.flops / 1e9).toFixed(3);
        $("rate").textContent = String(device.throughput());
        return;
      }
      log(`${event}${detail === undefined ? "" : `: ${detail}`}`);
    },
  });
  volunteer.device = device;
  $("stop").removeAttribute("disabled");
  $("stop").addEventListener("click", () => {
    device.stop();
    $("stop").setAttribute("disabled", "");
  });
  addEventListener("pagehide", () => device.stop());
  setState("connecting");
  await device.run();
}

main().catch((e) => {
  volunteer.error = String(e?.message ?? e);
  setState(`failed: ${volunteer.error}`, "down");
  log(volunteer.error);
});
