"""The engine, canonicalization and layout, the aiohttp app, the admin endpoint, the decorator, the CLI.

Only the CLI entry point exists so far.
"""
