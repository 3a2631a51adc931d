"""The cloud side: the WebSocket protocol, the worker over the engine core or an upstream server, the client."""
