"""What the proxy and its clients must agree on, in one small dependency-free package.

    frames   which frames of an episode are sent, at what size, at what presentation rate
    errors   every error code with its HTTP status and whether a client may retry it
    wire     paths, header names, Retry-After parsing
    strict_yaml  YAML that refuses duplicate keys (config files, templates, RLinf blocks)

Both `proxy` (the HTTP service) and `rlinf_client` import this package; neither imports the
other. Only the standard library is used here (PyYAML in strict_yaml, which both already need).
"""
