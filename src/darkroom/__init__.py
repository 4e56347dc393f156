"""darkroom: a photo-processing worker (Redis Streams → libvips renditions → PostgreSQL)."""

__version__ = "0.1.0"
