"""One pipeline per scoring mode, no HTTP framework: /score, /score/dense, /compare, the score:<backend>
chat models, the OpenAI pass-through, and the batch shape they share."""
