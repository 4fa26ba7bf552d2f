"""The HTTP layer — the only package that knows FastAPI, Starlette and uvicorn: the app and its
lifespan, the edge middleware, bodies, the error → HTTP mapping, OpenAPI, shutdown, and one
*_routes.py module per surface."""
