// sharp with its defaults on darkroom's default renditions: bench/limit.py's sharp column.
//
//     node bench/sharp/render.mjs PHOTO... > result.json
//
// Each photo gets the four renditions of DEFAULT_RENDITIONS (src/darkroom/settings.py), made
// the idiomatic sharp way: one auto-oriented pipeline per photo, cloned per rendition, fit
// inside the box, never enlarged, encoded to memory. Everything else is sharp's default (WebP
// effort, JPEG options, libvips concurrency, cache, libuv pool). os.cpus().length photos are in
// flight at once; the photos are read into memory first, one photo warms up, and the best of
// ROUNDS rounds is printed as JSON.
import { readFile } from "node:fs/promises";
import os from "node:os";
import sharp from "sharp";

const RENDITIONS = [
  { size: 320, format: "webp", quality: 80 },
  { size: 1024, format: "webp", quality: 80 },
  { size: 1024, format: "jpeg", quality: 82 },
  { size: 2048, format: "webp", quality: 80 },
];
const ROUNDS = 2;
const CORES = os.cpus().length;

async function render(data) {
  const photo = sharp(data).autoOrient();
  const outputs = RENDITIONS.map(({ size, format, quality }) =>
    photo
      .clone()
      .resize(size, size, { fit: "inside", withoutEnlargement: true })
      [format]({ quality })
      .toBuffer(),
  );
  return (await Promise.all(outputs)).reduce((total, buffer) => total + buffer.length, 0);
}

async function round(blobs) {
  let next = 0;
  const lane = async () => {
    while (next < blobs.length) await render(blobs[next++]);
  };
  const started = process.hrtime.bigint();
  await Promise.all(Array.from({ length: CORES }, lane));
  return blobs.length / (Number(process.hrtime.bigint() - started) / 1e9);
}

const paths = process.argv.slice(2);
if (paths.length === 0) {
  console.error("usage: node render.mjs PHOTO...");
  process.exit(2);
}
const blobs = await Promise.all(paths.map((path) => readFile(path)));
await render(blobs[0]);
const rounds = [];
for (let i = 0; i < ROUNDS; i++) rounds.push(await round(blobs));
console.log(
  JSON.stringify({
    photos: blobs.length,
    per_s: Math.max(...rounds),
    rounds,
    in_flight: CORES,
    sharp: sharp.versions.sharp,
    libvips: sharp.versions.vips,
    concurrency: sharp.concurrency(),
  }),
);
