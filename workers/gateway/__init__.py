"""The rollout gateway: OpenAI-compatible HTTP in front of token-in/token-out inference replicas.

Modules (one job each; import the one you need, nothing heavy is imported here):
  capture.py        sessions, secret tokens, CLEAN/FORK trajectory recording (pure)
  router.py         sticky-per-session / least-in-flight replica choice (pure)
  openai_api.py     Chat Completions request parsing, answer and error shapes (pure)
  chat_template.py  chat-template rendering and answer decoding with the HF tokenizer
  config.py         GatewayConfig
  app.py            aiohttp app factory: routes, auth, error middleware, metrics
  server.py         GatewayServer: the object rollout workers call (wrapped as an async Ray actor)
"""
