"""The base every layer may import: crash-safe files (`io`), process ranks (`distributed`), paired statistics
(`stats`), progress lines (`progress`), versions and provenance (`provenance`), the cache folder (`paths`).
Nothing here imports another vlmrl package."""
