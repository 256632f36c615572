"""The ``fast`` picker transport: a dedicated HTTP/2 server for the picker's two gRPC methods.

``h2conn`` is the sans-I/O connection (framing, HPACK, flow control, gRPC); ``server`` runs it on
asyncio (uvloop when installed), with SO_REUSEPORT, TLS (ALPN ``h2``) and graceful drain.
"""
