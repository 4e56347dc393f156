// Writes tests/thumbhash_random_vectors.json: the reference ThumbHash of seeded noise
// images (the same generator as tests/test_facts.py's _noise_image).
//   npm install thumbhash@0.1.1 && node tests/thumbhash_random.mjs > tests/thumbhash_random_vectors.json
import { rgbaToThumbHash } from "thumbhash";

function noiseImage(w, h, mode, seed) {
  let x = seed >>> 0;
  const next = () => {
    x ^= x << 13; x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5; x >>>= 0;
    return x & 255;
  };
  const out = new Uint8Array(w * h * 4);
  for (let i = 0; i < w * h; i++) {
    out[4 * i] = next(); out[4 * i + 1] = next(); out[4 * i + 2] = next();
    const a = next();
    out[4 * i + 3] = mode === "opaque" ? 255 : mode === "binary" ? (a & 1 ? 255 : 0) : a;
  }
  return out;
}

// Sides whose luminance count sits on a half: 7 × 30 / 84 = 2.5 and 5 × 50 / 100 = 2.5 (the
// header's shape), 7 × 18 / 28 = 4.5, 7 × 13 / 14 = 6.5 and 5 × 90 / 100 = 4.5 (how many
// terms); then sizes from a fixed list.
const cases = [
  [84, 30, "opaque"], [30, 84, "opaque"], [50, 100, "binary"], [100, 50, "partial"],
  [28, 18, "opaque"], [14, 13, "opaque"], [100, 90, "binary"], [90, 100, "partial"],
];
const modes = ["opaque", "binary", "partial"];
let s = 7;
for (let i = 0; i < 36; i++) {
  s = (s * 73 + 11) % 9973;
  cases.push([7 + (s % 94), 7 + ((s >> 3) % 94), modes[i % 3]]);
}
const vectors = cases.map(([w, h, mode], i) => {
  const seed = 1000 + i;
  const hash = Buffer.from(rgbaToThumbHash(w, h, noiseImage(w, h, mode, seed))).toString("base64");
  return { w, h, mode, seed, hash };
});
console.log(JSON.stringify(vectors, null, 1));
