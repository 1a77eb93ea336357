"""HTTP: the asyncio server with its limits, the exporter-toolkit web config, and the routes."""
