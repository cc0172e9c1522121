// An AudioWorklet processor that resamples its input (channel 0, at the context's rate) to
// 16 kHz and posts Float32Array pieces of about 100 ms to the page.
//
// Resampling: each output sample is the input convolved with a windowed-sinc low-pass
// (cut-off at 95 % of the lower Nyquist frequency, Hann window of HALF_WIDTH input samples
// per side at the input rate, scaled by the ratio when downsampling), centred on the
// output sample's position in the input; the input is kept as long as the kernel needs it.

const TARGET_RATE = 16000;
const HALF_WIDTH = 24;
const PIECE = 1600;

class Resampler extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ratio = sampleRate / TARGET_RATE;  // input samples per output sample
    this.scale = Math.min(1, 1 / this.ratio);  // cut-off relative to the input's Nyquist
    this.cutoff = 0.95 * this.scale;
    this.width = Math.ceil(HALF_WIDTH / this.scale);
    this.history = new Float32Array(0);  // input samples from index `base` on
    this.base = 0;
    this.next = 0;  // position of the next output sample, in input samples
    this.out = new Float32Array(PIECE);
    this.filled = 0;
    this.port.onmessage = (event) => {
      if (event.data === "flush") this.flush();
    };
  }

  kernel(x) {
    if (x === 0) return this.cutoff;
    if (Math.abs(x) >= this.width) return 0;
    const window = 0.5 + 0.5 * Math.cos(Math.PI * x / this.width);
    return Math.sin(Math.PI * this.cutoff * x) / (Math.PI * x) * window;
  }

  emit(value) {
    this.out[this.filled++] = value;
    if (this.filled === PIECE) this.flush();
  }

  flush() {
    if (this.filled > 0) {
      this.port.postMessage(this.out.slice(0, this.filled));
      this.filled = 0;
    }
  }

  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    if (this.ratio === 1) {
      for (let i = 0; i < input.length; i++) this.emit(input[i]);
      return true;
    }
    const joined = new Float32Array(this.history.length + input.length);
    joined.set(this.history);
    joined.set(input, this.history.length);
    const end = this.base + joined.length;  // input samples seen
    while (this.next + this.width < end) {
      const centre = this.next;
      const first = Math.max(this.base, Math.ceil(centre - this.width));
      const last = Math.floor(centre + this.width);
      let sum = 0;
      for (let k = first; k <= last; k++) {
        sum += joined[k - this.base] * this.kernel(centre - k);
      }
      this.emit(sum);
      this.next += this.ratio;
    }
    const keep = Math.max(this.base, Math.floor(this.next - this.width));
    this.history = joined.slice(keep - this.base);
    this.base = keep;
    return true;
  }
}

registerProcessor("resampler", Resampler);
