"""The queue: Redis Streams (every key derived here), entries, the in-flight owner, the pure
retry policy and pacing. Uses redis, settings and errors; knows nothing of images or stores."""
