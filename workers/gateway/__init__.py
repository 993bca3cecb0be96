"""The rollout gateway: OpenAI- and Anthropic-compatible HTTP in front of token-in/token-out
inference replicas.

Modules (one job each; import the one you need, nothing heavy is imported here):
  capture.py        sessions, secret tokens, turn cap, CLEAN/FORK trajectory recording (pure)
  router.py         sticky-per-session (spills when congested) / fewest-sessions replica choice, failed replicas out (pure)
  openai_api.py     Chat Completions request parsing, answer, chunk and error shapes (pure)
  anthropic_api.py  Messages request conversion, answer, event and error shapes (pure)
  tool_parsers.py   tool-call parsing in the template's format (hermes JSON, qwen3_coder XML) (pure)
  harmony.py        gpt-oss harmony: parse generated ids with openai-harmony, messages and template for rendering
  harmony_vocab.py  the o200k_base file openai-harmony loads, written from the served tokenizer (offline)
  template_registry.py  which family a chat template is, by content (pure)
  continuity.py / linear.py  prompts built on the recorded tokens (tree / linear history) (pure)
  auth.py           the session token of a request (Bearer or x-api-key)
  chat_template.py  chat-template rendering (segment-cached tokenization) and answer decoding
  turns.py          one turn: render, budget, route with failover, generate, parse, record
  streaming.py      server-sent-event answers
  metrics.py        GatewayMetrics counters
  config.py         GatewayConfig
  app.py            aiohttp app factory: routes, error middleware
  server.py         GatewayServer: the object rollout workers call (wrapped as an async Ray actor)
  client.py         GatewayClient: the typed adapter the driver calls the gateway through
"""
