"""The image: the pure libvips pipeline, the warm render pool, EXIF, ThumbHash, placeholders,
ISO-BMFF and GIF checks and the start-up self-check. Imports no I/O library and nothing of
queue, store or operate."""
