"""Reading the settings: DARKROOM_* variables (env), the Redis URL (redis_url) and the
converters both use (convert), each value validated into darkroom.settings' Settings.
"""
