"""Worker processes around one engine each, and the ZMQ/NIXL transport between them."""
