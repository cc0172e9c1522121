// The page of `python -m cat.serve`: microphone capture through an AudioWorklet resampled
// to 16 kHz (worklet.js), or a file decoded and resampled by the browser, streamed to the
// server's WebSocket (the protocol of cat/serving/protocol.py); partial text as it comes,
// final text with token times.
//
// For automation, `?autostart=SECONDS` records the microphone for that long as soon as the
// page loads, then ends the audio; when the server has closed the connection the body's
// `data-state` is "done" (or "error"), #final-text holds the final texts and
// `window.catMessages` every message of the connection.

"use strict";

const RATE = 16000;
const params = new URLSearchParams(location.search);
const socketUrl = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/";
const $ = (id) => document.getElementById(id);

function setState(state, text) {
  document.body.dataset.state = state;
  if (text !== undefined) {
    $("status").textContent = text;
    $("status").className = state === "error" ? "error" : "";
  }
}

function hotwords() {
  return $("hotwords").value.split("\n").map((line) => line.trim()).filter((line) => line);
}

function clock(seconds) {
  return seconds.toFixed(2);
}

// One connection: sends the start, queues audio until the server is ready, shows results.
class Connection {
  constructor(onClose) {
    this.queue = [];
    this.ready = false;
    this.socket = new WebSocket(socketUrl);
    this.socket.binaryType = "arraybuffer";
    this.socket.onopen = () => this.socket.send(JSON.stringify(
      {sample_rate: RATE, format: "float32", hotwords: hotwords()}));
    this.socket.onmessage = (event) => {
      const message = JSON.parse(event.data);
      window.catMessages.push(message);
      this.receive(message);
    };
    this.socket.onclose = (event) => onClose(event.code, event.reason);
    $("partial").textContent = "";
    $("final-text").textContent = "";
    $("finals").textContent = "";
    window.catMessages = [];
  }

  receive(message) {
    if (message.type === "ready") {
      this.ready = true;
      for (const piece of this.queue) this.socket.send(piece);
      this.queue = [];
      if (this.ended) this.socket.send(JSON.stringify({type: "end"}));
      return;
    }
    if (message.type === "partial") {
      $("partial").textContent = message.text;
      return;
    }
    $("partial").textContent = "";
    $("final-text").textContent += message.text;
    const item = document.createElement("li");
    const tokens = message.tokens;
    const end = tokens.length ? tokens[tokens.length - 1].end : message.start;
    const span = document.createElement("span");
    span.className = "time";
    span.textContent = `${clock(tokens.length ? tokens[0].start : message.start)}-${clock(end)} s`;
    item.append(span, document.createTextNode(message.text));
    const detail = document.createElement("span");
    detail.className = "tokens";
    for (const token of tokens) {
      const element = document.createElement("span");
      element.className = "token";
      element.textContent = `${token.text} ${clock(token.start)}-${clock(token.end)}`;
      detail.append(element);
    }
    item.append(detail);
    $("finals").append(item);
  }

  send(samples) {  // a Float32Array at 16 kHz
    const data = samples.buffer.slice(samples.byteOffset, samples.byteOffset + samples.byteLength);
    if (this.ready && this.socket.readyState === WebSocket.OPEN) this.socket.send(data);
    else if (!this.ready) this.queue.push(data);
  }

  end() {
    this.ended = true;
    if (this.ready && this.socket.readyState === WebSocket.OPEN) {
      this.socket.send(JSON.stringify({type: "end"}));
    }
  }
}

function closed(code, reason) {
  $("start").disabled = false;
  $("stop").disabled = true;
  $("upload").disabled = !$("file").files.length;
  if (code === 1000) setState("done", "done: the server sent the final results");
  else setState("error", `the server closed the connection: ${code} ${reason}`);
}

// -- microphone ---------------------------------------------------------------------------
let microphone = null;

async function startMicrophone() {
  $("start").disabled = true;
  setState("recording", "recording...");
  const stream = await navigator.mediaDevices.getUserMedia({audio: {
    channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false}});
  const context = new AudioContext();
  await context.resume();
  await context.audioWorklet.addModule("worklet.js");
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "resampler");
  const connection = new Connection(closed);
  node.port.onmessage = (event) => connection.send(event.data);
  source.connect(node);
  node.connect(context.destination);  // the node writes no output: silence
  microphone = {stream, context, node, connection};
  $("mic-state").textContent = `capturing at ${context.sampleRate} Hz, sending 16 kHz`;
  $("stop").disabled = false;
}

async function stopMicrophone() {
  if (!microphone) return;
  const {stream, context, node, connection} = microphone;
  microphone = null;
  $("stop").disabled = true;
  node.port.postMessage("flush");
  await new Promise((resolve) => setTimeout(resolve, 100));  // the last piece's message
  for (const track of stream.getTracks()) track.stop();
  await context.close();
  connection.end();
  setState("waiting", "waiting for the final results...");
}

// -- file ---------------------------------------------------------------------------------
async function transcribeFile() {
  const file = $("file").files[0];
  if (!file) return;
  $("upload").disabled = true;
  setState("uploading", `decoding ${file.name}...`);
  const decoder = new AudioContext();
  const decoded = await decoder.decodeAudioData(await file.arrayBuffer());
  await decoder.close();
  // The browser resamples (and mixes to one channel) to 16 kHz.
  const offline = new OfflineAudioContext(1, Math.ceil(decoded.duration * RATE), RATE);
  const source = offline.createBufferSource();
  source.buffer = decoded;
  source.connect(offline.destination);
  source.start();
  const samples = (await offline.startRendering()).getChannelData(0);
  setState("uploading", `sending ${decoded.duration.toFixed(1)} s of ${file.name}...`);
  const connection = new Connection(closed);
  for (let start = 0; start < samples.length; start += RATE / 2) {
    connection.send(samples.slice(start, start + RATE / 2));
  }
  connection.end();
}

// -- the page -----------------------------------------------------------------------------
function report(error) {
  setState("error", String(error));
}

$("start").onclick = () => startMicrophone().catch(report);
$("stop").onclick = () => stopMicrophone().catch(report);
$("upload").onclick = () => transcribeFile().catch(report);
$("file").onchange = () => { $("upload").disabled = !$("file").files.length; };

fetch("status").then((response) => response.json()).then((status) => {
  if (document.body.dataset.state !== "idle") return;
  $("status").textContent = status.streaming
    ? "ready: a streaming model (partial results as you speak)"
    : "ready: a full-context model (results per segment)";
}).catch(report);

const autostart = parseFloat(params.get("autostart"));
if (autostart > 0) {
  startMicrophone().then(() => new Promise((resolve) => setTimeout(resolve, autostart * 1000)))
    .then(stopMicrophone).catch(report);
}
