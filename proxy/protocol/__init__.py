"""The proxy's own API as data: one module per surface (score, dense, compare, progress) with its
request and response models, what the surfaces share (common), and the cheap reads of a JSON body
(json_peek). Part of the foundation: every layer may import it, and it imports only errors."""
