"""Request routing inside the proxy: which engines run a request (router, engine pool, P-to-D
links), the request's state per engine (legs), running it with retries and migration
(dispatch), and the in-flight bound (request tracker)."""
