"""The composition root: the one folder of the kernel that imports the apps and wires
them together (the NinjaAPI and urls, the ASGI and gRPC entry points, the WebSocket
routes, the `sluice` command). The rest of the kernel never imports it (the settings
name its modules; tests/sluice/test_kernel_imports.py holds the rule)."""
